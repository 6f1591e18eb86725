"""A picture of the block table and the block pool at one engine step (matplotlib, Agg).

Top: the table, one line per row (request) and one cell per logical block, colored by the
request that owns the physical block and labelled with its id. Blocks held by several requests
(a shared prompt prefix, reference count > 1) have their own hatched color and read
``id ×refcount``; a filled entry that holds the null block is dark; the space past a row's
filled entries is left blank. Each row's label says how many tokens it computes in the drawn
step (``+N tok``). Bottom: the pool, one cell per physical block: owned (the owner's color),
shared, free but still cached (reusable by a prefix hit until evicted), free, and the reserved
null block. A legend under the picture explains every mark.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from blocktable.constants import NULL_BLOCK_ID
from blocktable.engine.snapshot import TableSnapshot, pick_step, take_snapshot

__all__ = ["TableSnapshot", "draw_snapshot", "pick_step", "snapshot_figure", "take_snapshot"]

_EMPTY_COLOR = "#ffffff"  # past the row's filled entries
_NULL_ENTRY_COLOR = "#7f7f7f"  # a filled entry holding the null block
_SHARED_COLOR = "#c7b8e6"  # reference count > 1, whoever holds it
_FREE_COLOR = "#ffffff"
_CACHED_COLOR = "#fff2b3"
_NULL_BLOCK_COLOR = "#404040"
_POOL_CELLS_PER_LINE = 32


def draw_snapshot(snap: TableSnapshot, path: str | Path) -> Path:
    """Draw ``snap`` to a PNG at ``path`` (its folder must exist); return the path."""
    import matplotlib.pyplot as plt

    fig = snapshot_figure(snap)
    out = Path(path)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def snapshot_figure(snap: TableSnapshot) -> Any:
    """The matplotlib ``Figure`` of ``snap`` (Agg backend): the table above, the pool below."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch, Rectangle

    rows = sorted(snap.req_of_row)
    cmap = plt.get_cmap("tab10" if len(rows) <= 10 else "tab20")
    color_of_row = {row: cmap(i % cmap.N) for i, row in enumerate(rows)}
    # A block held by one request has that request's color; a shared one (refcount > 1) has
    # the shared color in every row and in the pool.
    owner_color: dict[int, object] = {}
    for row in rows:
        for b in snap.block_table[row, : snap.num_kernel_blocks[row]]:
            shared = snap.ref_counts[int(b)] > 1
            owner_color.setdefault(int(b), _SHARED_COLOR if shared else color_of_row[row])

    num_rows = len(snap.block_table)
    num_cols = int(snap.num_kernel_blocks.max(initial=0)) + 1  # one empty column past the end
    num_cols = min(num_cols, snap.block_table.shape[1]) if num_rows else 1
    num_blocks = len(snap.ref_counts)
    num_pool_lines = -(-num_blocks // _POOL_CELLS_PER_LINE)
    pool_cols = min(num_blocks, _POOL_CELLS_PER_LINE)

    fig_w = max(8.0, 1.8 + 0.42 * max(num_cols, pool_cols))
    fig_h = 1.6 + 0.42 * (max(num_rows, 1) + num_pool_lines) + 1.6
    fig, (ax_t, ax_p) = plt.subplots(
        2, 1, figsize=(fig_w, fig_h),
        gridspec_kw={"height_ratios": [max(num_rows, 1), num_pool_lines + 0.6]},
    )

    def cell(ax: object, x: float, y: float, color: object, text: str, shared: bool,
             text_color: str = "black", dotted: bool = False) -> None:
        ax.add_patch(Rectangle(  # type: ignore[attr-defined]
            (x, y), 1, 1, facecolor=color, edgecolor="black" if shared else "#808080",
            linewidth=1.4 if shared else 0.5, hatch="///" if shared else None,
            linestyle=":" if dotted else "-",
        ))
        box = {"facecolor": "white", "edgecolor": "none", "pad": 0.8} if shared else None
        ax.text(x + 0.5, y + 0.5, text, ha="center", va="center", fontsize=7,  # type: ignore[attr-defined]
                bbox=box, color=text_color)

    def block_text(b: int) -> str:  # a shared block shows its reference count: "7 ×3"
        return f"{b} ×{snap.ref_counts[b]}" if snap.ref_counts[b] > 1 else str(b)

    for row in range(num_rows):
        y = num_rows - 1 - row
        count = int(snap.num_kernel_blocks[row])
        for j in range(num_cols):
            b = int(snap.block_table[row, j])
            if j >= count:
                cell(ax_t, j, y, _EMPTY_COLOR, "", False, dotted=True)
            elif b == NULL_BLOCK_ID:
                cell(ax_t, j, y, _NULL_ENTRY_COLOR, "0", False, text_color="white")
            else:
                cell(ax_t, j, y, owner_color[b], block_text(b), snap.ref_counts[b] > 1)
    labels = []
    for row in range(num_rows):
        req = snap.req_of_row.get(row)
        label = f"row {row}: " + ("(free)" if req is None else req)
        if row in snap.num_new_tokens_of_row:
            label += f"  +{snap.num_new_tokens_of_row[row]} tok"
        labels.append(label)
    ax_t.set_yticks([num_rows - 1 - r + 0.5 for r in range(num_rows)], labels, fontsize=8)
    ax_t.set_xticks([j + 0.5 for j in range(num_cols)], [str(j) for j in range(num_cols)],
                    fontsize=7)
    bs = snap.block_size
    ax_t.set_xlabel(
        "logical block j = token j" if bs == 1
        else f"logical block j (tokens {bs}·j .. {bs}·j+{bs - 1})", fontsize=8,
    )
    ax_t.set_xlim(0, num_cols)
    ax_t.set_ylim(0, max(num_rows, 1))
    ax_t.set_title(
        f"block table at step {snap.step}: {_plural(snap.num_reqs_in_batch, 'request')} in "
        f"the batch, {_plural(len(snap.req_of_row), 'row')} held "
        "(+N tok: tokens the row computes in this step)", fontsize=10,
    )

    for b in range(num_blocks):
        x, y = b % _POOL_CELLS_PER_LINE, num_pool_lines - 1 - b // _POOL_CELLS_PER_LINE
        if b == NULL_BLOCK_ID:
            ax_p.add_patch(Rectangle((x, y), 1, 1, facecolor=_NULL_BLOCK_COLOR))
            ax_p.text(x + 0.5, y + 0.5, "0", ha="center", va="center", fontsize=7, color="white")
        elif snap.ref_counts[b] > 0:
            shared = bool(snap.ref_counts[b] > 1)
            color = _SHARED_COLOR if shared else owner_color.get(b, "#999999")
            cell(ax_p, x, y, color, block_text(b), shared)
        else:
            cell(ax_p, x, y, _CACHED_COLOR if snap.cached[b] else _FREE_COLOR, str(b), False)
    ax_p.set_xlim(0, pool_cols)
    ax_p.set_ylim(0, num_pool_lines)
    ax_p.set_xticks([])
    ax_p.set_yticks([])
    num_owned = int((snap.ref_counts[1:] > 0).sum())
    num_free_cached = int(((snap.ref_counts == 0) & snap.cached)[1:].sum())
    ax_p.set_title(
        f"block pool: {num_blocks} blocks, {num_owned} owned, {num_free_cached} free but "
        f"cached, {num_blocks - 1 - num_owned - num_free_cached} free", fontsize=10,
    )
    ax_p.legend(
        handles=[
            Patch(facecolor=_SHARED_COLOR, edgecolor="black", hatch="///",
                  label="shared: 'id ×n' = block id held by n requests"),
            Patch(facecolor=_CACHED_COLOR, edgecolor="#808080",
                  label="free, cached (a prefix hit can reuse it)"),
            Patch(facecolor=_FREE_COLOR, edgecolor="#808080", label="free"),
            Patch(facecolor=_NULL_BLOCK_COLOR, label="null block 0 (never handed out)"),
            Patch(facecolor=_NULL_ENTRY_COLOR, edgecolor="#808080",
                  label="filled entry holding the null block"),
            Patch(facecolor=_EMPTY_COLOR, edgecolor="#808080", linestyle=":",
                  label="empty: past the row's filled entries"),
            Patch(facecolor="#1f77b4", edgecolor="#808080",
                  label="other colors: the one request holding the block"),
        ],
        loc="upper center", bbox_to_anchor=(0.5, -0.05), ncol=3, fontsize=7, frameon=False,
    )
    for ax in (ax_t, ax_p):
        ax.set_aspect("equal")
        for side in ("top", "right", "bottom", "left"):
            ax.spines[side].set_visible(False)
        ax.tick_params(length=0)
    fig.tight_layout()
    return fig


def _plural(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"
