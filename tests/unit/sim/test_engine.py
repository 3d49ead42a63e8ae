from __future__ import annotations

import asyncio

import uvloop

from motor.sim.engine import Engine, EngineConfig, EngineRequest, SamplingSpec, Sequence, seed_material
from motor.sim.metrics import SimMetrics


def _run(coro):
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as r:
        return r.run(coro)


def _req(rid: str, prompt: list[int], max_tokens: int, n: int = 1, seed: int | None = None,
         stream: bool = False, **sp) -> EngineRequest:
    spec = SamplingSpec(max_tokens=max_tokens, seed=seed, **sp)
    r = EngineRequest(rid, stream, spec)
    for i in range(n):
        r.seqs.append(Sequence(r, i, prompt, max_tokens, seed_material(seed, rid, 0, prompt, i), 0))
    return r


async def _finish_all(eng: Engine, reqs: list[EngineRequest], timeout_s: float = 10.0) -> None:
    async def one(r: EngineRequest) -> None:
        while not r.done:
            r.take_dirty()
            await r.wait()
    await asyncio.wait_for(asyncio.gather(*(one(r) for r in reqs)), timeout_s)


def test_generates_deterministic_printable_text():
    async def main():
        eng = Engine(EngineConfig(time_scale=0))
        eng.start()
        a, b, c = (_req("a", [1, 2, 3], 40, seed=7), _req("b", [1, 2, 3], 40, seed=7),
                   _req("c", [1, 2, 3], 40, seed=8))
        for r in (a, b, c):
            eng.submit(r)
        await _finish_all(eng, [a, b, c])
        await eng.stop()
        return a, b, c
    a, b, c = _run(main())
    ta, tb, tc = (r.seqs[0].text for r in (a, b, c))
    assert ta == tb != tc
    assert len(ta) == 40 and all(32 <= ord(ch) < 127 for ch in ta)
    assert a.seqs[0].output_ids == list(ta.encode())
    assert a.seqs[0].finish_reason == "length" and a.seqs[0].stop_reason is None


def test_preemption_under_kv_pressure_still_finishes_everything():
    async def main():
        cfg = EngineConfig(time_scale=0, block_size=4, num_gpu_blocks=12, max_model_len=48)
        m = SimMetrics("m", 48)
        eng = Engine(cfg, m)
        eng.start()
        reqs = [_req(f"r{i}", list(range(10 + i, 20 + i)), 30) for i in range(3)]
        for r in reqs:
            eng.submit(r)
        await _finish_all(eng, reqs)
        await eng.stop()
        return eng, reqs
    eng, reqs = _run(main())
    assert eng.num_preemptions > 0
    for r in reqs:
        assert r.seqs[0].num_output == 30 and r.seqs[0].finish_reason == "length"
    assert eng.pool.num_free == eng.pool.num_blocks and not eng.running and not eng.waiting


def test_chunked_prefill_and_batch_caps():
    async def main():
        cfg = EngineConfig(time_scale=0, max_num_batched_tokens=8, max_num_seqs=2)
        eng = Engine(cfg)
        eng.start()
        seen_running = []
        reqs = [_req(f"r{i}", [65 + i] * 30, 5) for i in range(4)]
        for r in reqs:
            eng.submit(r)
        while not all(r.done for r in reqs):
            seen_running.append(len(eng.running))
            await asyncio.sleep(0)
        await eng.stop()
        return eng, reqs, seen_running
    eng, reqs, seen = _run(main())
    assert max(seen) <= 2
    assert eng.num_steps >= 4 * (30 // 8)  # each 30-token prompt needed several chunks
    assert all(r.seqs[0].num_output == 5 for r in reqs)


def test_abort_frees_blocks_and_counts():
    async def main():
        eng = Engine(EngineConfig(time_scale=1.0, step_fixed_ms=1))
        eng.start()
        r = _req("x", list(range(50)), 3000, stream=True)
        eng.submit(r)
        while r.seqs[0].num_output < 2:
            r.take_dirty()
            await r.wait()
        assert eng.pool.num_free < eng.pool.num_blocks
        eng.abort(r)
        await asyncio.sleep(0.01)
        await eng.stop()
        return eng, r
    eng, r = _run(main())
    assert r.done and r.seqs[0].finish_reason == "abort"
    assert eng.num_aborted == 1 and eng.pool.num_free == eng.pool.num_blocks
    assert not eng.running and not eng.waiting


def test_prefix_cache_hits_on_repeat():
    async def main():
        eng = Engine(EngineConfig(time_scale=0, block_size=16))
        eng.start()
        prompt = list(range(100))
        a = _req("a", prompt, 2)
        eng.submit(a)
        await _finish_all(eng, [a])
        b = _req("b", prompt, 2)
        eng.submit(b)
        await _finish_all(eng, [b])
        await eng.stop()
        return a, b
    a, b = _run(main())
    assert a.seqs[0].cached_tokens == 0 and b.seqs[0].cached_tokens == 96


def test_stop_strings_and_min_tokens():
    async def main():
        eng = Engine(EngineConfig(time_scale=0))
        eng.start()
        ref = _req("ref", [5, 6], 60, seed=3)
        eng.submit(ref)
        await _finish_all(eng, [ref])
        text = ref.seqs[0].text
        stop = text[20:23]
        s = _req("s", [5, 6], 60, seed=3, stop=(stop,))
        eng.submit(s)
        await _finish_all(eng, [s])
        await eng.stop()
        return text, stop, s.seqs[0]
    text, stop, seq = _run(main())
    assert seq.text == text[:text.find(stop)]
    assert seq.finish_reason == "stop" and seq.stop_reason == stop
    assert seq.num_output == text.find(stop) + len(stop)
