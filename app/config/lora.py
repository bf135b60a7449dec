"""LoRA adapters of a model (`models[].lora` in the Serve YAML); the tiny adapter CI serves: app/clusters/tiny_model.py.

Each adapter is an OpenAI `model` name of its own, served by its base model's replicas: a replica loads an adapter
into its engine on the first request for it (deployments/lora/adapters.py), keeps at most `max_loras` loaded and unloads
the least recently used idle one to make room; Summit's routers send an adapter's requests to a replica that has it
loaded (deployments/routing/routers.py), like Ray Serve's model multiplexing.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

# engine_kwargs that `lora:` sets (a YAML that sets them itself is pointed at `lora:`)
LORA_ENGINE_KEYS = ("enable_lora", "max_loras", "max_cpu_loras", "max_lora_rank")


class Adapter(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(description="The OpenAI `model` name of the adapter.")
    path: str = Field(
        description="A PEFT adapter directory (adapter_config.json + weights) on every node that runs "
        "the model's replicas; `$VAR`, `${VAR:-default}` and `~` are expanded where the replica starts."
    )

    @field_validator("name")
    @classmethod
    def _name_ok(cls, v: str) -> str:
        if not v or any(c.isspace() for c in v):
            raise ValueError("lora.adapters[].name must be non-empty without spaces, e.g. `name: sql-lora`")
        return v


class LoraOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    adapters: list[Adapter] = Field(default_factory=list, description="The adapters served on top of this model.")
    max_loras: int = Field(
        4,
        ge=1,
        description="Adapters one replica keeps loaded (vLLM's max_loras and "
        "max_cpu_loras): the least recently used idle one is unloaded to load another.",
    )
    max_lora_rank: int = Field(
        16, ge=1, description="The largest adapter rank (vLLM's max_lora_rank: 8, 16, 32, 64, 128, 256, 320 or 512)."
    )
    runtime_loading: bool = Field(
        False,
        description="Let `POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter` "
        "(vLLM's routes) add and remove this model's adapters while it runs; needs `auth` "
        "(API keys). docs/features/engine-features.md.",
    )

    @model_validator(mode="after")
    def _unique(self) -> LoraOptions:
        if not self.adapters and not self.runtime_loading:
            raise ValueError(
                "lora.adapters: list at least one adapter (name, path), or set `runtime_loading: true` to "
                "add them while the model runs"
            )
        names = [a.name for a in self.adapters]
        if dupes := sorted({n for n in names if names.count(n) > 1}):
            raise ValueError(f"lora.adapters[].name must be unique; repeated: {', '.join(dupes)}")
        return self

    def engine_kwargs(self) -> dict:
        return {
            "enable_lora": True,
            "max_loras": self.max_loras,
            "max_cpu_loras": self.max_loras,
            "max_lora_rank": self.max_lora_rank,
        }
