"""`models[].front_processes: auto` (the default) resolved by the builder (app/build/fronts.py): several processes for
a GPU model on the direct path, one wherever front processes cannot serve it; a count in the YAML is kept."""

from __future__ import annotations

import pytest

from app.build.fronts import auto_front_processes, resolve_front_processes
from app.config import SummitConfig


def gpu_model(**extra) -> SummitConfig:
    return SummitConfig.model_validate(
        {"models": [{"name": "g", "source": "/models/m", "accelerator": "gpu", **extra}]}
    )


@pytest.mark.parametrize(
    ("seqs", "cpus_per_gpu", "expected"),
    [
        (256, None, 4),  # one per 64 sequences, at most 4
        (1024, None, 4),
        (128, None, 2),
        (16, None, 1),
        (256, 8.0, 2),  # a quarter of the CPUs per GPU
        (256, 2.0, 1),
        (None, 16.0, 4),  # vLLM's default max_num_seqs (256)
    ],
)
def test_a_gpu_model_on_the_direct_path_gets_fronts_by_its_sequences_and_the_cpus(seqs, cpus_per_gpu, expected):
    kwargs = {} if seqs is None else {"engine_kwargs": {"max_num_seqs": seqs}}
    model = gpu_model(**kwargs).models[0]
    assert model.front_processes == "auto" and model.front_processes_set == 1
    assert auto_front_processes(model, direct=True, stored=False, cpus_per_gpu=cpus_per_gpu) == expected


@pytest.mark.parametrize(
    "why",
    ["cpu", "hops", "stored", "lora", "sleep"],
)
def test_auto_is_one_process_wherever_front_processes_cannot_serve(why):
    extra = {
        "cpu": {"accelerator": "cpu"},
        "lora": {"lora": {"adapters": [{"name": "sql", "path": "/adapters/sql"}]}},
        "sleep": {"deployment": {"sleep": {"after_idle_s": 5}}},
    }.get(why, {})
    model = gpu_model(**extra).models[0]
    # the control: the same model where nothing stands in the way gets several (so 1 below is the reason's doing)
    assert auto_front_processes(gpu_model().models[0], direct=True, stored=False, cpus_per_gpu=None) == 4
    direct, stored = why != "hops", why == "stored"
    assert auto_front_processes(model, direct=direct, stored=stored, cpus_per_gpu=None) == 1


def test_the_builder_replaces_auto_and_keeps_a_count():
    config = SummitConfig.model_validate(
        {
            "models": [
                {"name": "auto", "source": "/models/m", "accelerator": "gpu"},
                {"name": "two", "source": "/models/m", "accelerator": "gpu", "front_processes": 2},
                {"name": "cpu", "source": "/models/m", "accelerator": "cpu", "deployment": {"num_cpus": 0.5}},
            ]
        }
    )
    resolved = resolve_front_processes(config, direct=True, stored=False)
    assert [m.front_processes for m in resolved.models] == [4, 2, 1]
    hops = resolve_front_processes(config, direct=False, stored=False)
    assert [m.front_processes for m in hops.models] == [1, 2, 1]  # a count on hops is refused by check_front_processes
    assert config.models[0].front_processes == "auto"  # the YAML's config is left as it was
