"""Adapters loaded at run time (deployments/lora/runtime.py): the request checks, the registry, a replica's view of
it, and the config rule that runtime loading needs API keys. The engine side: tests/cpu/test_engine_features.py."""

from __future__ import annotations

import asyncio

import pytest

from app.config import SummitConfig
from deployments.http.errors import OpenAIError
from deployments.lora.adapters import Adapters
from deployments.lora.runtime import AdapterRegistry, RuntimeAdapters, check_adapter_dir, parse_load, parse_unload
from deployments.server.models import ModelTable


def test_a_load_names_the_adapter_its_path_and_its_model():
    assert parse_load({"lora_name": "sql", "lora_path": "/a"}, ["base"], {"base"}) == ("sql", "/a", "base")
    assert parse_load({"lora_name": "sql", "lora_path": "/a", "model": "b"}, ["a", "b"], {"a", "b"}) == (
        "sql",
        "/a",
        "b",
    )


@pytest.mark.parametrize(
    "payload, runtime, param, status",
    [
        (None, ["base"], None, 400),
        ([1], ["base"], None, 400),
        ({"lora_path": "/a"}, ["base"], "lora_name", 400),
        ({"lora_name": "two words", "lora_path": "/a"}, ["base"], "lora_name", 400),
        ({"lora_name": "sql"}, ["base"], "lora_path", 400),
        ({"lora_name": "sql", "lora_path": 3}, ["base"], "lora_path", 400),
        ({"lora_name": "sql", "lora_path": "/a"}, ["a", "b"], "model", 400),  # which model? two take adapters
        ({"lora_name": "sql", "lora_path": "/a", "model": "nope"}, ["base"], "model", 404),
        (
            {"lora_name": "sql", "lora_path": "/a", "model": "other"},
            ["base"],
            "model",
            400,
        ),  # served, no runtime loading
        ({"lora_name": "base", "lora_path": "/a"}, ["base"], "lora_name", 400),  # a model's name
        ({"lora_name": "taken", "lora_path": "/a"}, ["base"], "lora_name", 400),
    ],
)
def test_a_bad_load_is_refused_naming_the_field(payload, runtime, param, status):
    with pytest.raises(OpenAIError) as e:
        parse_load(payload, runtime, {"base", "other", "taken"})
    assert (e.value.param, e.value.status) == (param, status), str(e.value)


def test_an_unload_of_a_yaml_adapter_is_refused():
    assert parse_unload({"lora_name": "mine"}, {"yaml-one"}) == "mine"
    with pytest.raises(OpenAIError, match="Serve YAML"):
        parse_unload({"lora_name": "yaml-one"}, {"yaml-one"})


def test_the_path_must_hold_an_adapter(tmp_path):
    with pytest.raises(OpenAIError, match="adapter_config.json"):
        check_adapter_dir(str(tmp_path))
    (tmp_path / "adapter_config.json").write_text("{}")
    check_adapter_dir(str(tmp_path))


def test_the_registry_keeps_one_entry_per_name_and_versions_changes():
    r = AdapterRegistry()
    assert r.snapshot() == (0, {})
    assert r.add("sql", "base", "/a", "replica-1") and not r.add("sql", "base", "/b", "replica-2")
    assert r.snapshot() == (1, {"sql": ("base", "/a", "replica-1")})
    assert r.remove("sql") and not r.remove("sql")
    assert r.snapshot() == (2, {})


class _Remote:  # a DeploymentHandle's method, called in-process
    def __init__(self, fn):
        self.remote = lambda *a: _done(fn(*a))


async def _coro(value):
    return value


def _done(value):
    return _coro(value)


class _Handle:
    def __init__(self, registry: AdapterRegistry):
        for name in ("add", "remove", "snapshot"):
            setattr(self, name, _Remote(getattr(registry, name)))


def _Front(model: str, engine: list) -> ModelTable:  # noqa: N802 — a replica front's model table, fake engine
    async def load(name, path):
        engine.append(("load", name))
        return "bad rank" if "bad" in path else None

    async def unload(name):
        engine.append(("unload", name))

    return ModelTable(model, [model, "other"], adapters=Adapters({}, 2, load, unload))


def test_replicas_learn_and_forget_what_the_registry_holds(tmp_path):
    registry, engine = AdapterRegistry(), []
    mine, theirs = _Front("base", engine), _Front("other", [])
    views = [RuntimeAdapters(_Handle(registry), ["base"], set(), f"replica-{i}") for i in range(2)]
    good = tmp_path / "good"
    good.mkdir()
    (good / "adapter_config.json").write_text("{}")

    async def run():
        status, text = await views[0].handle(
            mine, "/v1/load_lora_adapter", {"lora_name": "sql", "lora_path": str(good)}, None
        )
        assert (status, "added successfully" in text) == (200, True)
        assert engine == [("load", "sql")] and mine.adapters.loaded() == ["sql"]  # loaded before the answer
        await views[1].refresh(theirs)  # another model's replica: knows the name and its model, loads nothing
        assert theirs.base_of == {"sql": "base"} and theirs.cards["sql"]["parent"] == "base"
        assert views[0].homes == views[1].homes == {"sql": "replica-0"}  # both report where it is loaded
        assert theirs.adapters.paths == {}
        with pytest.raises(OpenAIError):  # the name is taken now
            await views[1].handle(theirs, "/v1/load_lora_adapter", {"lora_name": "sql", "lora_path": "/x"}, None)
        status, _ = await views[1].handle(theirs, "/v1/unload_lora_adapter", {"lora_name": "sql"}, None)
        assert status == 200 and theirs.base_of == {} and views[1].homes == {}
        await views[0].refresh(mine)
        assert mine.base_of == {} and "sql" not in mine.adapters.paths and engine[-1] == ("unload", "sql")
        with pytest.raises(OpenAIError) as e:
            await views[0].handle(mine, "/v1/unload_lora_adapter", {"lora_name": "sql"}, None)
        assert e.value.status == 404

    asyncio.run(run())


def test_an_adapter_the_engine_refuses_is_not_kept(tmp_path):
    registry, engine = AdapterRegistry(), []
    front = _Front("base", engine)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "adapter_config.json").write_text("{}")
    view = RuntimeAdapters(_Handle(registry), ["base"], set())
    with pytest.raises(OpenAIError, match="bad rank") as e:
        asyncio.run(view.handle(front, "/v1/load_lora_adapter", {"lora_name": "b", "lora_path": str(bad)}, None))
    assert e.value.param == "lora_path"
    assert registry.snapshot()[1] == {} and front.adapters.paths == {} and front.base_of == {}


def test_a_load_for_another_models_replica_is_handed_over(tmp_path):
    forwarded = []

    async def forward(base):
        forwarded.append(base)

    view = RuntimeAdapters(_Handle(AdapterRegistry()), ["base"], set())
    answer = asyncio.run(
        view.handle(_Front("other", []), "/v1/load_lora_adapter", {"lora_name": "sql", "lora_path": "/a"}, forward)
    )
    assert answer is None and forwarded == ["base"]


def _config(runtime: bool, auth: bool) -> dict:
    model = {
        "name": "m",
        "source": "/m",
        "lora": {"runtime_loading": runtime, "adapters": [] if runtime else [{"name": "a", "path": "/a"}]},
    }
    return {"models": [model], **({"auth": {"api_keys_env": "KEYS"}} if auth else {})}


def test_runtime_loading_needs_api_keys():
    assert SummitConfig.model_validate(_config(True, True)).runtime_lora_models == ["m"]
    assert SummitConfig.model_validate(_config(False, False)).runtime_lora_models == []
    with pytest.raises(ValueError, match=r"runtime_loading.*auth"):
        SummitConfig.model_validate(_config(True, False))


def test_an_empty_adapter_list_needs_runtime_loading():
    config = _config(True, True)
    config["models"][0]["lora"]["runtime_loading"] = False
    with pytest.raises(ValueError, match="runtime_loading: true"):
        SummitConfig.model_validate(config)


def test_the_front_serves_the_routes_behind_the_key_and_documents_them(tmp_path):
    """Through the replica's ASGI front (a fake engine app): 404 while runtime loading is off; with it on, 401
    without the key, vLLM's plain-text 200, an OpenAI-shaped 400 naming the field, and the two operations in
    /openapi.json."""
    from tests.unit.test_front import EchoEngineApp, call, make_front

    adapter = tmp_path / "sql"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    engine = EchoEngineApp()
    engine.openapi = lambda: {"paths": {}, "components": {"schemas": {}}}  # vLLM's document: no OpenAI routes here
    app = make_front(engine, "a", ["a"], [b"k1"], lambda: False, "replica-1", {})
    key = {"authorization": "Bearer k1"}
    body = {"lora_name": "sql", "lora_path": str(adapter)}
    assert asyncio.run(call(app, "POST", "/v1/load_lora_adapter", body, key)).status_code == 404

    loaded = []

    async def load(name, path):
        loaded.append(name)

    async def unload(name):
        loaded.remove(name)

    app.table.adapters = Adapters({}, 2, load, unload)
    app.options.runtime_lora = RuntimeAdapters(_Handle(AdapterRegistry()), ["a"], set())
    assert asyncio.run(call(app, "POST", "/v1/load_lora_adapter", body)).status_code == 401
    r = asyncio.run(call(app, "POST", "/v1/load_lora_adapter", body, key))
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain") and loaded == ["sql"], r.text
    bad = asyncio.run(call(app, "POST", "/v1/load_lora_adapter", {"lora_name": "x"}, key))
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "lora_path"
    assert asyncio.run(call(app, "GET", "/v1/load_lora_adapter", None, key)).status_code == 405
    models = asyncio.run(call(app, "GET", "/v1/models", None, key)).json()["data"]
    assert [m["id"] for m in models if m.get("parent") == "a"] == ["sql"]
    assert asyncio.run(call(app, "POST", "/v1/unload_lora_adapter", {"lora_name": "sql"}, key)).status_code == 200
    assert loaded == []
    doc = asyncio.run(call(app, "GET", "/openapi.json")).json()
    assert {"/v1/load_lora_adapter", "/v1/unload_lora_adapter"} <= set(doc["paths"])
