"""LoRA adapters of a model (`models[].lora` in the Serve YAML) and the tiny adapter CI serves.

Each adapter is an OpenAI `model` name of its own, served by its base model's replicas: a replica loads an adapter
into its engine on the first request for it (deployments/adapters.py), keeps at most `max_loras` loaded and unloads
the least recently used idle one to make room; Summit's routers send an adapter's requests to a replica that has it
loaded (deployments/routers.py), like Ray Serve's model multiplexing.
"""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

# engine_kwargs that `lora:` sets (a YAML that sets them itself is pointed at `lora:`)
LORA_ENGINE_KEYS = ("enable_lora", "max_loras", "max_cpu_loras", "max_lora_rank")


class Adapter(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(description="The OpenAI `model` name of the adapter.")
    path: str = Field(description="A PEFT adapter directory (adapter_config.json + weights) on every node that runs "
                      "the model's replicas; `$VAR`, `${VAR:-default}` and `~` are expanded where the replica starts.")

    @field_validator("name")
    @classmethod
    def _name_ok(cls, v: str) -> str:
        if not v or any(c.isspace() for c in v):
            raise ValueError("lora.adapters[].name must be non-empty without spaces, e.g. `name: sql-lora`")
        return v


class LoraOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    adapters: list[Adapter] = Field(default_factory=list, description="The adapters served on top of this model.")
    max_loras: int = Field(4, ge=1, description="Adapters one replica keeps loaded (vLLM's max_loras and "
                           "max_cpu_loras): the least recently used idle one is unloaded to load another.")
    max_lora_rank: int = Field(16, ge=1, description="The largest adapter rank (vLLM's max_lora_rank: 8, 16, 32, 64, "
                               "128, 256, 320 or 512).")
    runtime_loading: bool = Field(False, description="Let `POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter` "
                                  "(vLLM's routes) add and remove this model's adapters while it runs; needs `auth` "
                                  "(API keys). README: LoRA adapters.")

    @model_validator(mode="after")
    def _unique(self) -> LoraOptions:
        if not self.adapters and not self.runtime_loading:
            raise ValueError("lora.adapters: list at least one adapter (name, path), or set `runtime_loading: true` to "
                             "add them while the model runs")
        names = [a.name for a in self.adapters]
        if dupes := sorted({n for n in names if names.count(n) > 1}):
            raise ValueError(f"lora.adapters[].name must be unique; repeated: {', '.join(dupes)}")
        return self

    def engine_kwargs(self) -> dict:
        return {"enable_lora": True, "max_loras": self.max_loras, "max_cpu_loras": self.max_loras,
                "max_lora_rank": self.max_lora_rank}


def make_tiny_lora(base_dir: str | Path, out_dir: str | Path, seed: int = 1, rank: int = 8) -> Path:
    """A real PEFT LoRA adapter for the tiny model under `base_dir` (q/k/v/o projections of every layer), random
    A and B (PEFT starts B at zero, which would leave the base model's output unchanged), deterministic per seed."""
    import torch
    from safetensors.torch import save_file

    cfg = json.loads((Path(base_dir).expanduser() / "config.json").read_text())
    h, hd = cfg["hidden_size"], cfg["head_dim"]
    outs = {"q_proj": cfg["num_attention_heads"] * hd, "k_proj": cfg["num_key_value_heads"] * hd,
            "v_proj": cfg["num_key_value_heads"] * hd, "o_proj": h}
    ins = {"q_proj": h, "k_proj": h, "v_proj": h, "o_proj": cfg["num_attention_heads"] * hd}
    gen = torch.Generator().manual_seed(seed)
    weights = {}
    for i in range(cfg["num_hidden_layers"]):
        for module, out_features in outs.items():
            key = f"base_model.model.model.layers.{i}.self_attn.{module}"
            weights[f"{key}.lora_A.weight"] = torch.randn(rank, ins[module], generator=gen) * 0.3
            weights[f"{key}.lora_B.weight"] = torch.randn(out_features, rank, generator=gen) * 0.3
    out = Path(out_dir).expanduser().resolve()
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in weights.items()}, str(out / "adapter_model.safetensors"),
              metadata={"format": "pt"})
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(Path(base_dir).expanduser()),
        "r": rank, "lora_alpha": 2 * rank, "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False,
        "target_modules": sorted(outs), "modules_to_save": None, "use_rslora": False, "use_dora": False}, indent=2))
    return out
