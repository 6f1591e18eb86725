"""The engine with a host tier: offloaded and restored KV gives transformers' tokens."""

from __future__ import annotations

import pytest
import torch

from blocktable.engine import EngineConfig, LLMEngine, tiny_llama
from blocktable.engine.host_cache import HostKVCache
from blocktable.engine.verify import verify_requests
from blocktable.host_tier import HostTransfers


def test_host_kv_cache_copies_blocks_both_ways() -> None:
    kv = torch.arange(2 * 2 * 5 * 2 * 1 * 3, dtype=torch.float32).reshape(2, 2, 5, 2, 1, 3)
    cache = HostKVCache(kv, 3)
    before = kv.clone()
    cache.transfer(HostTransfers(torch.tensor([[4, 1], [2, 3]]).int().numpy(),
                                 torch.zeros((0, 2), dtype=torch.int32).numpy()))
    assert torch.equal(cache.host[:, :, 1], before[:, :, 4])
    assert torch.equal(cache.host[:, :, 3], before[:, :, 2])
    kv[:, :, 1:].zero_()
    cache.transfer(HostTransfers(torch.zeros((0, 2), dtype=torch.int32).numpy(),
                                 torch.tensor([[3, 1], [1, 2]]).int().numpy()))
    assert torch.equal(kv[:, :, 1], before[:, :, 2]) and torch.equal(kv[:, :, 2], before[:, :, 4])
    assert cache.stats.num_offloaded_blocks == 2 and cache.stats.num_restored_blocks == 2
    assert cache.stats.offloaded_bytes == 2 * 2 * 2 * 2 * 3 * 4


@pytest.mark.parametrize("bad", [0, -3])
def test_host_kv_cache_rejects_bad_sizes(bad: int) -> None:
    with pytest.raises(ValueError, match="num_host_blocks"):
        HostKVCache(torch.zeros(1, 2, 3, 4, 1, 2), bad)


def test_host_kv_cache_rejects_more_than_host_memory() -> None:
    kv = torch.zeros(1, 2, 3, 1024, 16, 128)  # 16 MiB per block
    with pytest.raises(ValueError, match="host memory"):
        HostKVCache(kv, 2**30)


def test_engine_restores_prefixes_from_the_host_and_matches_transformers() -> None:
    model = tiny_llama(seed=0)
    prompts = [[(7 * p + 3 * i) % 250 + 1 for i in range(24)] for p in range(3)]  # 6 blocks
    engine = LLMEngine(model, EngineConfig(block_size=4, num_blocks=12, max_num_reqs=1,
                                           token_budget=32, max_model_len=64, host_blocks=32))
    n = 0
    for wave in range(2):
        for p, prompt in enumerate(prompts):
            engine.add_request(f"w{wave}p{p}", [*prompt, 200 + wave], max_new_tokens=3)
            while engine.has_unfinished():
                engine.step()
            n += 1
    stats = engine.manager.prefix_cache_stats
    assert stats.num_host_hit_tokens >= 3 * 24  # every second-wave prompt came from the host
    assert engine.host_cache is not None and engine.host_cache.stats.num_restored_blocks >= 18
    assert all(v.ok for v in verify_requests(model, engine.requests.values()))
    engine.manager.check_integrity()


def test_demo_offload_restores_and_verifies(capsys: pytest.CaptureFixture[str]) -> None:
    from blocktable.cli import main

    code = main(["demo", "--offload", "--quiet", "--num-blocks", "12", "--max-new-tokens", "3"])
    out = capsys.readouterr().out
    assert code == 0, out
    line = next(li for li in out.splitlines() if li.startswith("host tier:"))
    restored = int(line.split("restored ")[1].split()[0])
    served = int(line.split("blocks, ")[2].split()[0])
    assert restored > 0 and served > 0
    assert "match transformers" in out


def test_demo_offload_refuses_dcp(capsys: pytest.CaptureFixture[str]) -> None:
    from blocktable.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["demo", "--offload", "--dcp", "2"])
    assert exc.value.code == 2
    assert "--offload" in capsys.readouterr().err
