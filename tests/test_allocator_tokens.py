"""TokenPages: every write and read against per-row Python lists, on random operations."""

from __future__ import annotations

import numpy as np
import pytest

from blocktable.allocator.tokens import TokenPages, page_size_for


@pytest.mark.parametrize("seed", range(8))
def test_token_pages_equal_per_row_lists(seed: int) -> None:
    rng = np.random.default_rng(seed)
    num_rows = 12
    size = int(rng.choice([4, 8, 64]))
    pages = TokenPages(num_rows, size)
    model: dict[int, list[int]] = {}
    for _ in range(300):
        op = rng.integers(0, 5)
        free = [r for r in range(num_rows) if r not in model]
        if op == 0 and free:  # a row starts with a prompt
            row = int(rng.choice(free))
            prompt = rng.integers(-5, 1 << 40, int(rng.integers(1, 5 * size)))
            pages.write(row, 0, prompt)
            model[row] = prompt.tolist()
        elif op == 1 and model:  # one row appends
            row = int(rng.choice(list(model)))
            new = rng.integers(0, 1000, int(rng.integers(0, 3 * size)))
            pages.write(row, len(model[row]), new)
            model[row] += new.tolist()
        elif op == 2 and model:  # several rows append k each
            rows = rng.permutation(list(model))[: int(rng.integers(1, len(model) + 1))]
            k = int(rng.integers(0, 2 * size))
            block = rng.integers(0, 1000, (len(rows), k))
            starts = np.array([len(model[int(r)]) for r in rows], dtype=np.int64)
            pages.write_rows(rows.astype(np.intp), starts, block)
            for r, new in zip(rows.tolist(), block.tolist()):
                model[r] += new
        elif op == 3 and model:  # rows leave (keeping a few pages, or none)
            rows = [int(r) for r in rng.permutation(list(model))[: int(rng.integers(1, 3))]]
            pages.release(rows, keep=int(rng.integers(0, 3)))
            for r in rows:
                del model[r]
        elif model:  # reads of segments of many rows (a decode step's blocks, or anything)
            rows = list(model)
            picked = rng.permutation(rows)[: int(rng.integers(1, len(rows) + 1))]
            starts, lengths = [], []
            for r in picked.tolist():
                n = len(model[r])
                if rng.random() < 0.5 and n >= 4:  # equal lengths, each in one page when small
                    length = 4
                else:
                    length = int(rng.integers(1, n + 1))
                starts.append(int(rng.integers(0, n - length + 1)))
                lengths.append(length)
            keep = [i for i, length in enumerate(lengths) if length <= len(model[picked[i]])]
            picked = picked[keep]
            s, ln = np.array(starts)[keep], np.array(lengths)[keep]
            got = pages.read_many(picked.astype(np.intp), s.astype(np.int64), ln.astype(np.int64))
            want = [t for r, a, n in zip(picked.tolist(), s.tolist(), ln.tolist())
                    for t in model[r][a : a + n]]
            assert got.tolist() == want
        for r, tokens in model.items():
            assert pages.read(r, 0, len(tokens)).tolist() == tokens
            assert int(pages.num_pages[r]) >= -(-len(tokens) // size)
        # no page lost or held twice (free rows keep a few)
        listed = np.concatenate(
            [pages.table[r, : pages.num_pages[r]] for r in range(num_rows)]
            + [pages._free[: pages._num_free]]
        )
        assert sorted(listed.tolist()) == list(range(len(pages.pages)))


def test_page_size_holds_the_largest_block() -> None:
    assert page_size_for((16,)) == 64
    assert page_size_for((16, 128)) == 128
    assert page_size_for((48, 200)) == 256
