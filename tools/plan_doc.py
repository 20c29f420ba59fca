"""The figures of docs/memory_plan.md, from the planner: each block between `<!-- plan:NAME -->` and
`<!-- /plan:NAME -->` there is what one function here returns, so the page is regenerated, not typed.

  python tools/plan_doc.py            # rewrite the blocks (a minute or two on 2 cores: two searches)
  python tools/plan_doc.py --check    # exit 1 naming the blocks that differ from the planner's

tests/test_plan_search.py checks the cheap blocks and the 384-rank search table on every run.
"""
from __future__ import annotations

import argparse
import dataclasses
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "memory_plan.md"
PRESET = ROOT / "configs" / "kimi_k2_1t.toml"
GB = 1e9
LEVERS = [("the preset", {}),
          ("the preset before issue 43: 14 sequences, 16 MoE token chunks, bf16 expert gathers",
           {"train.batch_size": 5376, "memory.block_chunks": 1, "model.moe.token_chunks": 16,
            "mesh.expert_gather_dtype": "compute"}),
          ("whole-block chunks alone (bf16 expert gathers)", {"mesh.expert_gather_dtype": "compute"}),
          ("20 sequences a GPU in 10 block chunks", {"train.batch_size": 7680, "memory.block_chunks": 10}),
          ("`--optim.qk-clip` (MuonClip: the attention leaves gathered again)", {"optim.qk_clip": True}),
          ("`--train.no-donate` (the functional update)", {"train.donate": False}),
          ("`--plan.network-gbps 25` (NDR200's line rate)", {"plan.network_gbps": 25.0}),
          ("`--plan.imbalance 1` (every rank as loaded as the mean)", {"plan.imbalance": 1.0}),
          ("`--plan.hbm-tbps 1000` (no expert GEMM bound by HBM)", {"plan.hbm_tbps": 1000.0})]
"""(what the row says, the preset's fields it changes): the levers table"""


def preset():
    from fnmoe.config import load_config
    return load_config(PRESET)


def changed(run, fields: dict):
    """run with dotted fields replaced (section.field, or model.moe.field)."""
    for path, value in fields.items():
        *parents, name = path.split(".")
        chain = [run]
        for p in parents:
            chain.append(getattr(chain[-1], p))
        new = dataclasses.replace(chain[-1], **{name: value})
        for owner, p in zip(reversed(chain[:-1]), reversed(parents)):
            new = dataclasses.replace(owner, **{p: new})
        run = new
    return run


def preset_block() -> str:
    from fnmoe.plan.summary import format_plan, plan
    return "```\n" + format_plan(plan(preset())) + "\n```"


def levers_block() -> str:
    from fnmoe.plan.summary import plan
    rows = ["| change | as built / serial tokens/s/GPU | compute s | fsdp across nodes s | device GB | host GB pinned |"
            " fits |", "|---|---|---|---|---|---|---|"]
    for label, fields in LEVERS:
        p = plan(changed(preset(), fields))
        t, r = p["step_time"], p["per_rank_bytes"]
        fits = {(True, True): "yes", (False, True): "no: device", (True, False): "no: host"}.get(
            (p["fits"]["device"], p["fits"]["host"]), "no: device and host")
        rows.append(f"| {label} | {t['tokens_per_s_per_gpu_as_built']:,.0f} / "
                    f"{t['tokens_per_s_per_gpu_serial']:,.0f} | {t['compute_s']:.2f} | "
                    f"{t['terms_s']['fsdp across nodes']:.2f} | {r['total_device'] / GB:.1f} | "
                    f"{r['host_pool'] / GB:.1f} | {fits} |")
    return "\n".join(rows)


def search_table(s: dict) -> str:
    """A search's ranking (fnmoe.plan.search.search) as a markdown table."""
    from fnmoe.plan.search import DTYPE_SHORT, chunks_label
    rows = ["| # | fsdp x ep | memory | seq/GPU | mb x acc | reduce | expert gather | chunks | CE chunks | device GB |"
            " host GB | as built | overlapped | serial | compute | fsdp | ep inside | ep across | bound |",
            "|" + "---|" * 19]
    for i, r in enumerate(s["ranking"], 1):
        t = r["terms_s"]
        rows.append(f"| {i} | {r['fsdp']} x {r['ep']} | {r['policy']} | {r['sequences_per_gpu']} | "
                    f"{r['micro_batch']} x {r['grad_accum']} | {DTYPE_SHORT[r['reduce_dtype']]} | "
                    f"{'fp8' if r['expert_gather_dtype'] == 'float8_e4m3fn' else 'compute'} | "
                    f"{chunks_label(r)} | {r['ce_chunks']} | {r['device_bytes'] / GB:.1f} | "
                    f"{r['host_bytes'] / GB:.1f} | "
                    f"{r['tokens_per_s_per_gpu']:,.0f}{'' if r['as_built'] else '*'} | "
                    f"{r['tokens_per_s_per_gpu_overlapped']:,.0f} | {r['tokens_per_s_per_gpu_serial']:,.0f} | "
                    f"{t['compute']:.2f} | {t['fsdp inside node'] + t['fsdp across nodes']:.2f} | "
                    f"{t['ep inside node']:.2f} | {t['ep across nodes']:.2f} | {r['bound']} |")
    return (f"{s['candidates']:,} layouts planned, {s['fitting']:,} fit {s['hbm_gb']:g} GB HBM and "
            f"{s['host_gb']:g} GB host (the pool pinned) a GPU, {s['as_built_planned']} projected as built "
            "(the rest cannot beat the tenth); seconds a step:\n\n" + "\n".join(rows))


def search_block() -> str:
    from fnmoe.plan.search import search
    return search_table(search(preset()))


NEMO_K2_H100 = 924
"""NeMo AutoModel's measured tokens/s/GPU for Kimi-K2 on 256 H100 (PP8 x EP32; the validation section)"""


def dgx_block() -> str:
    """The best K2 layout on 256 x dgx-h100 with the donated update (the default), its as-built and
    measured-rate figures beside NeMo AutoModel's measured one, and the search with the functional update."""
    from fnmoe.plan.search import search
    run = changed(preset(), {"plan.hardware": "dgx-h100"})
    try:
        s = search(run, world=256, top=1)
    except ValueError as e:  # nothing fits: the search's own line
        return f"> {e}"
    best = s["ranking"][0]
    try:
        search(changed(run, {"train.donate": False}), world=256, top=1)
        functional = "fits too"
    except ValueError as e:
        functional = str(e)
    return (search_table(s) + f"\n\nAs built {best['tokens_per_s_per_gpu']:,.0f} tokens/s/GPU, "
            f"{best['tokens_per_s_per_gpu_beside']:,.0f} at the measured rates, beside NeMo AutoModel's measured "
            f"{NEMO_K2_H100:,} (PP8 x EP32). With the functional update (`--train.no-donate`): {functional}.")


SEED = {"mesh.fsdp": 48, "mesh.ep": 8, "train.batch_size": 1536, "train.grad_accum": 1,
        "mesh.expert_gather_dtype": "compute", "mesh.reduce_dtype": "float32", "memory.offload": False,
        "memory.block_chunks": 1, "model.moe.token_chunks": 1}
"""TorchTitan's K2 recipe on the preset's 384 GPUs: EP 8, 4 x 4,096 tokens a GPU, bf16 gathers, fp32
reduce-scatters, full activation checkpointing, nothing offloaded"""
SEED_TARGET = 1300


def seed_block() -> str:
    """The seed's recipe through the planner, and what a GPU's NIC carries a step: the bytes that do
    not grow with tokens (the FSDP gathers and reduce-scatters) and those that do (EP rows across
    nodes), so the tokens a GPU needs for the seed's ~1,300 tokens/s/GPU from the NIC alone."""
    from fnmoe.plan.summary import plan
    rows = ["| layout | tokens a GPU | NIC GB a step (FSDP + EP) | NIC s at the profile's rate | the NIC's ceiling "
            "tok/s/GPU | as built (stated / measured rates) | tokens a GPU for 1,300 (NIC alone) |",
            "|---|---|---|---|---|---|---|"]
    layouts = (("TorchTitan's K2 recipe: EP 8 over 2 nodes, bf16 gathers", SEED),
               ("the same with EP 4 inside the node", {**SEED, "mesh.fsdp": 96, "mesh.ep": 4}),
               ("EP 4 inside the node, fp8 expert gathers", {**SEED, "mesh.fsdp": 96, "mesh.ep": 4,
                                                              "mesh.expert_gather_dtype": "float8_e4m3fn"}))
    for label, fields in layouts:
        run = changed(preset(), fields)
        p, net = plan(run), p_net(run)
        c, tokens = p["comm_bytes_detail"], p["tokens_per_rank_microbatch"] * run.train.grad_accum
        fixed, per_token = c["fsdp_inter_node"], c["ep_inter_node"] / tokens
        need = SEED_TARGET * fixed / (net - SEED_TARGET * per_token) if SEED_TARGET * per_token < net else None
        nic_s = (fixed + per_token * tokens) / net
        b = p["step_time_beside"]
        rows.append(f"| {label} | {tokens:,} | {fixed / GB:,.0f} + {per_token * tokens / GB:,.0f} | {nic_s:.1f} | "
                    f"{tokens / nic_s:,.0f} | {p['step_time']['tokens_per_s_per_gpu_as_built']:,.0f} / "
                    f"{b['tokens_per_s_per_gpu_as_built']:,.0f} | "
                    f"{'never: its EP rows alone pass the NIC' if need is None else f'{need:,.0f}'} |")
    return "\n".join(rows)


def p_net(run) -> float:
    """The profile's achieved cross-node bytes a second a GPU."""
    from fnmoe.config.hardware import hardware
    return hardware(run.plan).network_gbps * GB


BLOCKS = {"preset": preset_block, "levers": levers_block, "search-384": search_block, "dgx-h100": dgx_block,
          "seed": seed_block}


def block_re(name: str) -> re.Pattern:
    return re.compile(rf"(<!-- plan:{name} -->\n)(.*?)(\n<!-- /plan:{name} -->)", re.S)


def block_text(doc: str, name: str) -> str:
    """The text of a block of the page as it stands."""
    m = block_re(name).search(doc)
    if not m:
        raise SystemExit(f"{DOC}: no block <!-- plan:{name} --> ... <!-- /plan:{name} -->")
    return m.group(2)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 naming the blocks that differ; write nothing")
    ap.add_argument("blocks", nargs="*", default=list(BLOCKS), help=f"which of {', '.join(BLOCKS)} (default all)")
    args = ap.parse_args(argv)
    doc = DOC.read_text()
    stale = []
    for name in args.blocks:
        new = BLOCKS[name]()
        if block_text(doc, name) != new:
            stale.append(name)
            doc = block_re(name).sub(lambda m: m.group(1) + new + m.group(3), doc)
    if args.check:
        print(f"stale blocks: {', '.join(stale)}" if stale else "every block is current", file=sys.stderr)
        return 1 if stale else 0
    DOC.write_text(doc)
    print(f"rewrote {', '.join(stale) or 'nothing'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
