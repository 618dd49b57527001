"""Names in a Hugging Face / official DeepSeek-V3 checkpoint vs the names of our state_dict, and the load plan.

Differences (everything else is the same name):
  checkpoint                                            ours
  model.layers.L.mlp.experts.e.{gate,up}_proj.weight    model.layers.L.mlp.experts.gate_up_proj[e, :I | I:]  [E,2I,D]
  model.layers.L.mlp.experts.e.down_proj.weight         model.layers.L.mlp.experts.down_proj[e]              [E,D,I]
  model.layers.{N+k}.X                                  mtp.k.X   (N = num_hidden_layers)
  model.layers.{N+k}.embed_tokens.weight                (copy of model.embed_tokens.weight: shape-checked, dropped)
  model.layers.{N+k}.shared_head.head.weight            (copy of lm_head.weight: shape-checked, dropped)
  X.weight_scale_inv                                    (FP8 block scales of X.weight: applied on load)
transformers v5 saves the per-expert layout by default; with save_original_format=False it writes the fused
`mlp.experts.gate_up_proj` / `mlp.experts.down_proj`, which are our names and load as they are.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from anyseek.hf.fp8 import scale_shape
from anyseek.hf.safetensors_io import TensorInfo

_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_EXPERT = re.compile(r"mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight")
_MTP = re.compile(r"mtp\.(\d+)\.(.+)")
_SHARED_COPIES = {"embed_tokens.weight": "model.embed_tokens.weight", "shared_head.head.weight": "lm_head.weight"}
_IGNORED = re.compile(r".*rotary_emb\.inv_freq")  # old transformers checkpoints carry this buffer
SCALE_SUFFIX = "_scale_inv"


@dataclass(frozen=True)
class Target:
    """Where a checkpoint tensor goes. kind: 'tensor' (ours[name]), 'expert' (slice of a stacked tensor),
    'copy' (MTP copy of a shared tensor: check the shape, drop), 'ignore', or 'unknown'."""

    kind: str
    name: str = ""
    expert: int = -1
    part: str = ""  # gate | up | down


def to_ours(hf_name: str, n_layers: int, n_mtp: int) -> Target:
    """Map one checkpoint name to our state_dict (layers N.. N+n_mtp-1 are MTP modules)."""
    if _IGNORED.fullmatch(hf_name):
        return Target("ignore")
    m = _LAYER.fullmatch(hf_name)
    if not m:
        return Target("tensor", hf_name)
    layer, rest = int(m.group(1)), m.group(2)
    prefix = f"model.layers.{layer}." if layer < n_layers else f"mtp.{layer - n_layers}."
    if n_layers <= layer < n_layers + n_mtp and rest in _SHARED_COPIES:
        return Target("copy", _SHARED_COPIES[rest])
    e = _EXPERT.fullmatch(rest)
    if e:
        stacked = "down_proj" if e.group(2) == "down" else "gate_up_proj"
        return Target("expert", f"{prefix}mlp.experts.{stacked}", int(e.group(1)), e.group(2))
    return Target("tensor", prefix + rest)


def to_hf(name: str, n_layers: int) -> str:
    """Our (non-expert) state_dict name -> checkpoint name."""
    m = _MTP.fullmatch(name)
    return f"model.layers.{n_layers + int(m.group(1))}.{m.group(2)}" if m else name


def expert_names(stacked_hf: str, n_experts: int) -> list[tuple[str, int, str]]:
    """'...mlp.experts.gate_up_proj' -> [(per-expert checkpoint name, e, part)] for every expert."""
    base = stacked_hf.rsplit(".", 1)[0]
    parts = ("down",) if stacked_hf.endswith("down_proj") else ("gate", "up")
    return [(f"{base}.{e}.{p}_proj.weight", e, p) for e in range(n_experts) for p in parts]


@dataclass
class Piece:
    """One checkpoint tensor (plus its FP8 scale) and where it lands in its target: expert -1 = the whole target,
    else target[expert, rows]."""

    info: TensorInfo
    scale: TensorInfo | None = None
    expert: int = -1
    rows: slice = field(default_factory=lambda: slice(None))


@dataclass
class LoadPlan:
    pieces: dict[str, list[Piece]] = field(default_factory=dict)  # our name -> its sources
    missing: list[str] = field(default_factory=list)  # checkpoint names
    unexpected: list[str] = field(default_factory=list)  # "name (file)"
    misshaped: list[str] = field(default_factory=list)  # "name (file): expected [..], found [..]"
    present: set[str] = field(default_factory=set)  # checkpoint names found with a wrong shape (not "missing")


def _where(info: TensorInfo) -> str:
    return f"{info.name} ({info.file.name})"


def _bad_shape(info: TensorInfo, want: tuple[int, ...], note: str = "") -> str:
    return f"{_where(info)}: expected {list(want)}, found {list(info.shape)}{note}"


def plan_load(
    expected: dict[str, tuple[int, ...]],
    ckpt: dict[str, TensorInfo],
    n_layers: int,
    n_mtp: int,
    block: tuple[int, int],
    tied: dict[str, tuple[int, ...]] | None = None,
) -> LoadPlan:
    """Match checkpoint tensors (headers only) to our `expected` {name: shape}; collect every problem by name.
    `tied`: {name: shape} of parameters tied to an expected one (e.g. lm_head.weight): shape-checked, not loaded."""
    tied = tied or {}
    plan = LoadPlan()
    scales = {n[: -len(SCALE_SUFFIX)]: i for n, i in ckpt.items() if n.endswith(SCALE_SUFFIX)}
    for weight, s in scales.items():
        if weight not in ckpt:
            plan.unexpected.append(_where(s) + " (FP8 scale without its weight)")
    for name, info in ckpt.items():
        if name.endswith(SCALE_SUFFIX):
            continue
        scale = scales.get(name)
        if not _check_fp8(info, scale, block, plan):
            continue
        t = to_ours(name, n_layers, n_mtp)
        if t.kind == "ignore":
            continue
        if t.kind == "copy" or t.name in tied:  # a second copy of a tensor we hold once: check, drop
            want = tied.get(t.name, expected.get(t.name))
            if want is None:
                plan.unexpected.append(_where(info))
            elif info.shape != want:
                plan.misshaped.append(_bad_shape(info, want, f" (copy of {t.name})"))
        elif t.name not in expected:
            plan.unexpected.append(_where(info))
        elif t.kind == "tensor":
            if info.shape != expected[t.name]:
                plan.misshaped.append(_bad_shape(info, expected[t.name]))
                plan.present.add(t.name)
            else:
                plan.pieces.setdefault(t.name, []).append(Piece(info, scale))
        else:
            _plan_expert(t, info, scale, expected[t.name], plan)
    _check_coverage(expected, plan, n_layers)
    return plan


def _check_fp8(info: TensorInfo, scale: TensorInfo | None, block: tuple[int, int], plan: LoadPlan) -> bool:
    if not info.dtype.startswith("F8"):
        if scale is not None:
            plan.unexpected.append(_where(scale) + f" (scale for a {info.dtype} weight)")
        return True
    if scale is None:
        plan.misshaped.append(f"{_where(info)}: {info.dtype} weight without {info.name}{SCALE_SUFFIX}")
        return False
    if len(info.shape) != 2 or scale.shape != scale_shape(info.shape, block):
        want = scale_shape(info.shape, block) if len(info.shape) == 2 else "a 2-D weight"
        plan.misshaped.append(
            f"{_where(scale)}: expected {want} for weight {list(info.shape)} in {block[0]}x{block[1]} blocks, "
            f"found {list(scale.shape)}"
        )
        return False
    return True


def _plan_expert(t: Target, info: TensorInfo, scale: TensorInfo | None, stacked: tuple[int, ...], plan: LoadPlan):
    n_experts, rows, cols = stacked
    inter = rows // 2
    want = (rows, cols) if t.part == "down" else (inter, cols)
    if t.expert >= n_experts:
        plan.unexpected.append(_where(info) + f" (expert {t.expert} >= n_routed_experts {n_experts})")
    elif info.shape != want:
        plan.misshaped.append(_bad_shape(info, want, f" (expert slice of {t.name} {list(stacked)})"))
        plan.present.add(info.name)
    else:
        sl = {"gate": slice(0, inter), "up": slice(inter, rows), "down": slice(None)}[t.part]
        plan.pieces.setdefault(t.name, []).append(Piece(info, scale, t.expert, sl))


def _check_coverage(expected: dict[str, tuple[int, ...]], plan: LoadPlan, n_layers: int) -> None:
    for name, shape in expected.items():
        pieces = plan.pieces.get(name, [])
        hf = to_hf(name, n_layers)
        whole = [p for p in pieces if p.expert < 0]
        if not pieces and name in plan.present:
            continue
        stacked = name.endswith(("experts.gate_up_proj", "experts.down_proj"))
        if not pieces and not (stacked and any(n in plan.present for n, _, _ in expert_names(hf, shape[0]))):
            if stacked:
                base = hf.rsplit(".", 1)[0]
                parts = "down" if name.endswith("down_proj") else "{gate,up}"
                plan.missing.append(f"{base}.{{0..{shape[0] - 1}}}.{parts}_proj.weight (or fused {hf})")
            else:
                plan.missing.append(hf)
            continue
        if whole:
            for p in pieces[1:]:
                plan.unexpected.append(_where(p.info) + f" (duplicate source for {hf})")
            plan.pieces[name] = pieces[:1]
            continue
        have = {(p.expert, p.rows.start) for p in pieces}
        for ename, e, part in expert_names(hf, shape[0]):
            start = {"gate": 0, "up": shape[1] // 2, "down": None}[part]
            if (e, start) not in have and ename not in plan.present:
                plan.missing.append(ename)
