"""Sleep mode's logic (deployments/server/sleep.py, gpu_share.py) with a fake engine (named FakeEngine: it records
sleeps and wakes and checks that no two engines of one GPU are awake at once), and its YAML checks. The real engine's
sleep and a real swap run in tests/cpu/test_engine_features.py and on the GPU (bench/sleep_swap.py)."""

from __future__ import annotations

import asyncio

import pytest

from app.build.options import llm_deployment_options
from app.config import SummitConfig
from app.config.options import SleepOptions
from deployments.http.errors import OpenAIError
from deployments.server.gpu_share import GpuTurns
from deployments.server.sleep import Sleeper
from tests.aio import until


class FakeEngine:
    """Stands in for vLLM's engine: sleep/wake take `delay_s`; `gpu` is the set of awake engines on its GPU."""

    def __init__(self, name: str, gpu: set[str] | None = None, delay_s: float = 0.01):
        self.name, self.gpu, self.delay_s = name, gpu if gpu is not None else set(), delay_s
        self.calls: list[str] = []
        self.overlaps = 0  # wakes that found another engine of the GPU awake
        self.fail_next_wake = False
        self.running = lambda: (
            0
        )  # how many requests run on this engine (its Sleeper's in_flight, where a test links it)
        self.slept_mid_request = 0  # sleeps asked for while a request ran on the engine

    async def start(self) -> str:
        self._up()
        return self.name

    def _up(self) -> None:
        if self.gpu - {self.name}:
            self.overlaps += 1
        self.gpu.add(self.name)

    async def sleep(self, level: int) -> None:
        self.slept_mid_request += self.running() > 0
        await asyncio.sleep(self.delay_s)
        self.gpu.discard(self.name)
        self.calls.append(f"sleep{level}")

    async def wake(self, level: int) -> None:
        await asyncio.sleep(self.delay_s)
        if self.fail_next_wake:
            self.fail_next_wake = False
            raise RuntimeError("CUDA out of memory")
        self._up()
        self.calls.append("wake")


class LocalTurns:
    """A member's side of an in-process GpuTurns (what gpu_share.ShareGroupClient is through Ray)."""

    def __init__(self, turns: GpuTurns, member: str):
        self.turns, self.member = turns, member

    async def acquire(self) -> None:
        await self.turns.acquire(self.member, poll_s=0.05)

    async def release(self) -> None:
        await self.turns.release(self.member)

    async def wanted(self, timeout_s: float = 0.05) -> bool:
        return await self.turns.wanted(self.member, timeout_s)


async def _use(sleeper: Sleeper, seconds: float, log: list[str] | None = None, tag: str = "") -> None:
    async with sleeper.use():
        if log is not None:
            log.append(f"{tag} start")
        await asyncio.sleep(seconds)
        if log is not None:
            log.append(f"{tag} end")


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, 20))


def test_an_idle_engine_sleeps_and_the_next_request_wakes_it():
    async def scenario():
        engine = FakeEngine("a")
        sleeper = Sleeper(engine, SleepOptions(after_idle_s=0.2))
        await sleeper.start(engine.start)
        await _use(sleeper, 0.3)  # a request longer than the idle time: no sleep while it runs
        assert engine.calls == []
        for _ in range(40):
            await asyncio.sleep(0.05)
            if not sleeper.awake:
                break
        assert engine.calls == ["sleep1"] and sleeper.stats()["asleep"]
        await _use(sleeper, 0.0)  # waits for the wake, then runs
        assert engine.calls == ["sleep1", "wake"] and sleeper.awake
        assert sleeper.stats()["wakes"] == 1 and sleeper.stats()["last_wake_s"] is not None
        sleeper.stop()

    _run(scenario())


def test_a_failed_wake_answers_its_waiters_503_and_the_next_request_tries_again():
    async def scenario():
        engine = FakeEngine("a")
        sleeper = Sleeper(engine, SleepOptions(after_idle_s=0.1, level=2))
        await sleeper.start(engine.start)
        assert await sleeper.put_to_sleep("test")
        engine.fail_next_wake = True
        with pytest.raises(OpenAIError) as refused:
            await _use(sleeper, 0.0)
        assert refused.value.status == 503 and "could not wake" in str(refused.value)
        await _use(sleeper, 0.0)
        assert engine.calls == ["sleep2", "wake"] and sleeper.awake
        sleeper.stop()

    _run(scenario())


async def _two_sharing(min_awake_s: float) -> tuple[dict[str, FakeEngine], dict[str, Sleeper]]:
    """Models a and b on one GPU (fake engines), both started: a first, then b in its turn."""
    gpu: set[str] = set()
    turns = GpuTurns()
    engines = {n: FakeEngine(n, gpu) for n in ("a", "b")}
    options = SleepOptions(min_awake_s=min_awake_s)
    sleepers = {n: Sleeper(e, options, LocalTurns(turns, n), n) for n, e in engines.items()}
    for n in ("a", "b"):
        await sleepers[n].start(engines[n].start)
    return engines, sleepers


def test_models_sharing_a_gpu_take_turns_one_awake_and_never_mid_request():
    async def scenario():
        engines, sleepers = await _two_sharing(min_awake_s=0.1)  # b's start waited for a's turn to end
        assert engines["a"].calls == ["sleep1"] and sleepers["b"].awake and not sleepers["a"].awake
        log: list[str] = []
        # b runs a request; a's request arrives while it runs and must wait for its end (never mid-request), then a
        # wakes. b's request ends only once a is seen waiting for the GPU's turn (no wall-clock windows)
        b_running, b_may_end = asyncio.Event(), asyncio.Event()

        async def b_request() -> None:
            async with sleepers["b"].use():
                log.append("b start")
                b_running.set()
                await b_may_end.wait()
                log.append("b end")

        engines["b"].running = lambda: sleepers["b"].in_flight
        b = asyncio.create_task(b_request())
        await b_running.wait()
        a = asyncio.create_task(_use(sleepers["a"], 0.0, log, "a"))
        # b is asked to yield the GPU (it stops admitting) while its request runs: it must wait for it to end
        await until(lambda: not sleepers["b"].admitting or a.done())
        b_may_end.set()
        await asyncio.gather(a, b)
        assert engines["b"].slept_mid_request == 0 and log == ["b start", "b end", "a start", "a end"], log
        assert engines["b"].calls == ["sleep1"] and engines["a"].calls == ["sleep1", "wake"]
        assert engines["a"].overlaps == engines["b"].overlaps == 0
        # what the real-engine test reads: a's wake began after b's sleep ended
        woke_at, slept_at = sleepers["a"].stats()["woke_at"], sleepers["b"].stats()["slept_at"]
        assert slept_at is not None and woke_at >= slept_at
        for s in sleepers.values():
            s.stop()

    _run(scenario())


def test_a_busy_model_yields_the_gpu_after_min_awake_s_so_the_other_is_not_starved():
    async def scenario():
        engines, sleepers = await _two_sharing(min_awake_s=0.2)
        served: list[str] = []

        async def busy(name: str, requests: int) -> None:  # back-to-back requests, never idle
            for _ in range(requests):
                await _use(sleepers[name], 0.02)
                served.append(name)

        # 30 requests of 0.02 s each: 0.6 s of work apiece, three times min_awake_s; without the yield the first
        # model to hold the GPU would serve all its 30 before the other got one (a single switch)
        await asyncio.gather(busy("a", 30), busy("b", 30))
        switches = sum(1 for x, y in zip(served, served[1:]) if x != y)
        assert switches >= 3, served  # each got the GPU again and again
        assert engines["a"].overlaps == engines["b"].overlaps == 0
        for s in sleepers.values():
            s.stop()

    _run(scenario())


def test_turns_go_in_arrival_order_and_a_holder_whose_process_is_gone_loses_its_turn():
    async def scenario():
        gone: set[str] = set()
        turns = GpuTurns(alive=lambda member: member not in gone)
        assert await turns.acquire("a")
        b = asyncio.create_task(turns.acquire("b", poll_s=0.01))
        await until(lambda: turns.state()["waiting"] == ["b"])
        c = asyncio.create_task(turns.acquire("c", poll_s=0.01))
        await until(lambda: turns.state()["waiting"] == ["b", "c"])
        assert await turns.wanted("a", 0.5)
        assert turns.state() == {"holder": "a", "waiting": ["b", "c"]}
        await turns.release("a")
        assert await b
        assert turns.holder == "b" and not c.done()
        await asyncio.sleep(0.1)  # however long b holds it (its engine starting), c waits
        assert turns.holder == "b" and not c.done()
        gone.add("b")  # b's process died
        assert await asyncio.wait_for(c, 1)
        assert turns.holder == "c"
        gone.add("d")
        assert not await turns.acquire("d", poll_s=0.01)  # a call whose caller died claims nothing

    _run(scenario())


def _config(models: list[dict]) -> SummitConfig:
    return SummitConfig.model_validate({"models": models})


def test_share_with_gives_each_replica_a_fraction_of_one_gpu_and_sleep_mode():
    config = _config(
        [
            {"name": "a", "source": "/a"},
            {"name": "b", "source": "/b", "share_with": "a"},
            {"name": "c", "source": "/c", "share_with": "a", "deployment": {"sleep": {"level": 2}}},
            {"name": "d", "source": "/d"},
        ]
    )
    a, b, c, d = config.models
    assert [m.share_group for m in config.models] == [("a", 3), ("a", 3), ("a", 3), None]
    assert llm_deployment_options(a)["ray_actor_options"]["num_gpus"] == pytest.approx(1 / 3, abs=1e-3)
    assert llm_deployment_options(d)["ray_actor_options"]["num_gpus"] == 1
    assert a.sleep == SleepOptions() and c.sleep.level == 2 and d.sleep is None
    # a sleeping model gets Summit's router, which reads which replicas sleep
    assert "request_router_config" in llm_deployment_options(
        b
    ) and "request_router_config" not in llm_deployment_options(d)


@pytest.mark.parametrize(
    ("second", "key"),
    [
        ({"share_with": "nope"}, "models['b'].share_with"),
        ({"share_with": "b"}, "models['b'].share_with"),
        ({"share_with": "a", "tensor_parallel_size": 2}, "tensor_parallel_size"),
        ({"share_with": "a", "deployment": {"autoscaling_config": {"max_replicas": 2}}}, "autoscaling_config"),
        ({"share_with": "a", "accelerator": "cpu"}, "models['b'].accelerator"),
        ({"deployment": {"sleep": {"after_idle_s": 5}}, "front_processes": 2}, "front_processes"),
        ({"deployment": {"sleep": {"level": 2}}, "engine_kwargs": {"load_format": "dummy"}}, "sleep.level"),
    ],
)
def test_a_yaml_that_cannot_sleep_or_share_is_refused_naming_the_key(second, key):
    with pytest.raises(ValueError) as refused:
        _config([{"name": "a", "source": "/a"}, {"name": "b", "source": "/b", **second}])
    assert key in str(refused.value)


def test_a_chain_of_share_with_is_refused_naming_the_model_to_share_with():
    with pytest.raises(ValueError, match="name the model the group shares with \\('a'\\)"):
        _config(
            [
                {"name": "a", "source": "/a"},
                {"name": "b", "source": "/b", "share_with": "a"},
                {"name": "c", "source": "/c", "share_with": "b"},
            ]
        )
