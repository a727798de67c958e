"""Behind a load balancer: nginx (deploy/nginx/nginx.conf) in front of two gateways, two workers,
one Redis. Concurrent streams all complete through it; SIGKILL of one gateway mid-run fails only
the streams it carried, new requests go to the other, and the workers abort the dead gateway's
requests (slots and KV blocks freed)."""

from __future__ import annotations

import asyncio
import json
import signal
from collections.abc import Iterator
from dataclasses import dataclass, field

import aiohttp
import pytest

from tests.deploy.lb import Nginx, write_slow_model
from tests.services import (
    JitneyProcess,
    RedisServer,
    Worker,
    free_port,
    serving,
    start_worker,
    wait_for,
    wait_ready,
)

pytestmark = pytest.mark.slow

MODEL = "slow-random"  # the directory name is the served model name
LONG_TOKENS = 2500  # ~40 s of decoding here: far longer than the gateway heartbeat TTL (5 s)


@dataclass
class Stack:
    lb: Nginx
    workers: list[Worker]
    gateways: dict[int, JitneyProcess]  # port -> process

    def metric(self, name: str, **labels: str) -> float:
        return sum(w.metric(name, **labels) for w in self.workers)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    model_dir = write_slow_model(tmp_path_factory.mktemp("model") / MODEL)
    server = RedisServer().start()
    # Room for a few long requests per worker (8 KiB of KV per token); a quick teardown.
    flags = ("--kv-cache-memory", "128MiB", "--shutdown-timeout", "2")
    workers = [start_worker(server, f"lb-w{i}", *flags, model=str(model_dir)) for i in (1, 2)]
    gateways: dict[int, JitneyProcess] = {}
    for name in ("lb-gw-a", "lb-gw-b"):
        port = free_port()
        args = ["gateway", "--host", "127.0.0.1", "--port", str(port), "--gateway-id", name]
        gateways[port] = JitneyProcess(args, {"REDIS_URL": server.url}, name=name)
    lb = Nginx(list(gateways))
    try:
        wait_ready(server.client(), *workers)
        for port, proc in gateways.items():

            def ready(port: int = port, proc: JitneyProcess = proc) -> bool:
                assert proc.alive(), proc.output()
                return serving(f"http://127.0.0.1:{port}")

            wait_for(ready, 60, f"gateway :{port} /ready and its model listed")
        lb.start()
        yield Stack(lb, workers, gateways)
    finally:
        lb.close()
        for proc in gateways.values():
            proc.stop()
        for w in workers:
            w.proc.stop()
        server.close()


@dataclass(eq=False)  # compared by identity
class StreamResult:
    upstream: str = ""  # the gateway nginx chose, host:port
    tokens: int = 0
    done: bool = False  # saw `data: [DONE]`
    error: str | None = None  # transport error, or an error chunk
    started: asyncio.Event = field(default_factory=asyncio.Event)


async def stream(
    session: aiohttp.ClientSession, base: str, max_tokens: int, result: StreamResult | None = None
) -> StreamResult:
    """A streamed completion through the balancer, recorded into `result` chunk by chunk."""
    result = result or StreamResult()
    body = {
        "model": MODEL,
        "prompt": "tell me a long story",
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    try:
        async with session.post(f"{base}/v1/completions", json=body) as resp:
            result.upstream = resp.headers.get("X-Jitney-Upstream", "")
            if resp.status != 200:
                result.error = f"HTTP {resp.status}: {await resp.text()}"
                return result
            async for raw in resp.content:
                line = raw.decode().strip()
                if line == "data: [DONE]":
                    result.done = True
                elif line.startswith("data: "):
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        result.error = json.dumps(chunk["error"])
                    elif chunk["choices"]:
                        result.tokens += 1
                        if result.tokens >= 2:
                            result.started.set()
    except (TimeoutError, aiohttp.ClientError) as e:
        result.error = f"{type(e).__name__}: {e}"
    finally:
        result.started.set()  # never leave a waiter hanging
    return result


def port_of(upstream: str) -> int:
    return int(upstream.rsplit(":", 1)[1])


async def test_concurrent_streams_through_the_balancer_all_complete(stack: Stack) -> None:
    async with aiohttp.ClientSession() as session:
        results = await asyncio.gather(*[stream(session, stack.lb.url, 12) for _ in range(8)])
    for r in results:
        assert r.error is None and r.done, r
        assert r.tokens > 0
    # least_conn spreads concurrent streams: both gateways served some.
    assert {port_of(r.upstream) for r in results} == set(stack.gateways)


async def test_killing_one_gateway_fails_only_its_streams(stack: Stack) -> None:
    aborted_before = stack.metric("jitney_requests_finished_total", reason="abort")
    length_before = stack.metric("jitney_requests_finished_total", reason="length")
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        results = [StreamResult() for _ in range(4)]
        tasks = [
            asyncio.create_task(stream(session, stack.lb.url, LONG_TOKENS, r)) for r in results
        ]
        for r in results:
            await asyncio.wait_for(r.started.wait(), 60)
        ports = [port_of(r.upstream) for r in results]
        victim = ports[0]
        survivor = next(p for p in stack.gateways if p != victim)
        assert survivor in ports, f"all streams went to one gateway: {ports}"
        on_victim = [r for r in results if port_of(r.upstream) == victim]
        on_survivor = [r for r in results if port_of(r.upstream) == survivor]

        stack.gateways[victim].stop(signal.SIGKILL)

        # The victim's streams end at the client without [DONE]: truncated, with an error.
        await asyncio.wait_for(
            asyncio.gather(*[t for t, r in zip(tasks, results, strict=True) if r in on_victim]), 30
        )
        for r in on_victim:
            assert not r.done and r.error is not None, r

        # New requests keep succeeding: nginx skips the dead gateway.
        fresh = await asyncio.gather(*[stream(session, stack.lb.url, 8) for _ in range(4)])
        for r in fresh:
            assert r.done and r.error is None, r
            assert port_of(r.upstream) == survivor

        # The survivor's streams never noticed: still flowing.
        counts = [r.tokens for r in on_survivor]
        for _ in range(200):  # up to 10 s for each to get another token
            if all(r.tokens > c for r, c in zip(on_survivor, counts, strict=True)):
                break
            await asyncio.sleep(0.05)
        else:
            raise AssertionError(f"the survivor's streams stalled: {on_survivor}")
        assert all(r.error is None and not r.done for r in on_survivor), on_survivor

        # The workers abort the dead gateway's requests once its heartbeat lapses (no client is
        # left to cancel them) while the survivor's keep running. Natural ends would take ~40 s
        # more and would count as `length`: those must not happen.
        def victim_stopped() -> bool:
            return stack.metric("jitney_requests_running") == len(on_survivor)

        await asyncio.to_thread(
            wait_for, victim_stopped, 20, "workers to stop the dead gateway's requests"
        )
        length_now = stack.metric("jitney_requests_finished_total", reason="length")
        assert length_now == length_before + len(fresh)  # only the fresh ones ran to the end
        assert stack.metric(
            "jitney_requests_finished_total", reason="abort"
        ) - aborted_before == len(on_victim)

        for task in tasks:
            task.cancel()  # the clients of the survivor's streams leave
        await asyncio.gather(*tasks, return_exceptions=True)

    def idle() -> bool:
        return stack.metric("jitney_requests_running") == 0 and all(
            w.metric("jitney_kv_blocks_free") == w.metric("jitney_kv_blocks_total")
            for w in stack.workers
        )

    await asyncio.to_thread(wait_for, idle, 30, "slots and KV blocks freed on both workers")
