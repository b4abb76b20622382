"""The experts module a converted block holds: this rank's experts in the kernels' layout,
checkpointed in the layout of the transformers module it replaced.

A converted model must load the checkpoints written for the unconverted one, and write
checkpoints the unconverted one loads: :class:`TransformersExperts` keeps ``w13`` /
``w2`` (and ``b13`` / ``b2``) for the kernels but saves and loads them under the replaced
module's keys and in its layout (fused ``gate_up_proj`` / ``down_proj``, per-expert
``{e}.gate_proj.weight``, stacked ``mlp.w1`` / ``mlp.v1`` / ``mlp.w2``), sliced to this
rank's experts under expert parallelism, and to its F shard of each under a (tp, ep)
layout (:mod:`comet.mesh`). FP8 experts (:class:`Fp8TransformersExperts`) keep the
checkpoint's own tensors, keys and dtypes. The conversions themselves are
:mod:`comet.integrations.layout`'s; this module decides which keys a rank writes, which
it takes and what it reports as missing, unexpected or mismatched.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from comet.config import MoEConfig
from comet.integrations.fp8 import Fp8Checkpoint
from comet.integrations.layout import (_FUSED_BIASES, _FUSED_KEYS, _LINEAR_NAMES, _PARTS,
                                       ExpertLayout, _fused_to_kernel, _gate_then_up,
                                       _kernel_to_stacked, _linear_to_kernel, _models_order,
                                       _stacked_to_kernel, ffn_columns)
from comet.moe import LocalExperts
from comet.quant import Fp8Weight, device_only, fp8_experts
from comet.weights import gate_up_first, interleave_gate_up


def _call_block(experts: nn.Module, hidden_states: torch.Tensor,
                top_k_index: torch.Tensor | None, top_k_weights: torch.Tensor | None
                ) -> torch.Tensor:
    """An experts module's call, run by the CometMoEBlock that owns it."""
    block = experts._comet_block
    if block is None:
        raise RuntimeError("these experts are not attached to a CometMoEBlock "
                           "(build them with comet.integrations.from_module)")
    return block.call_experts(hidden_states, top_k_index, top_k_weights)


class TransformersExperts(LocalExperts):
    """This rank's experts (``w13 [El, H, 2F]`` interleaved, ``w2 [El, F, H]``, and with
    ``cfg.expert_bias`` ``b13 [El, 2F]`` / ``b2 [El, H]``; see
    :class:`comet.moe.LocalExperts`) -- under a (tp, ep) layout, the F columns
    ``ffn_cols`` of each (``F / tp`` of them; ``b2`` whole, replicated over the TP
    group) --, checkpointed in the models' layout under the keys of the transformers
    experts module they replace.

    Called the way the replaced module was called, it runs the experts on comet through
    the block that owns it (:meth:`comet.CometMoE.experts_forward`):
    ``experts(hidden [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H]``
    (routed experts; stacked ones take and return ``[batch, seq, H]``) or
    ``experts(routed_in [E*T, H]) -> [E*T, H]`` (dense experts).

    ``state_dict()`` writes ``gate_up_proj``/``down_proj`` and the biases the module had
    (``gate_up_proj_bias``/``down_proj_bias``), gate and up in the module's column order
    (fused layout; with EP, this rank's ``[El, ...]`` slice), the three stacked tensors
    under their paths (stacked layout, e.g. DBRX's ``mlp.w1``/``mlp.v1``/``mlp.w2``: with
    EP, this rank's ``[El*F, H]`` rows), or ``{e}.{gate,up,down}.weight`` (and ``.bias``)
    for this rank's experts under their *global* index ``e`` (per-expert layout). Under a
    (tp, ep) layout every tensor holds this rank's F shard where the model's has ``F``
    (``[El, 2Ft, H]``, ``[El*Ft, H]``, ``{e}.gate_proj.weight [Ft, H]``, ...), the keys
    unchanged.
    ``load_state_dict()`` accepts fused and per-expert checkpoints whatever the layout, and
    stacked ones in the stacked layout: full ``[E, ...]`` fused or ``[E*F, H]`` stacked
    tensors are sliced to this rank (experts, then F shard), per-expert keys of other
    ranks' experts are dropped and full-width ones sliced to the F shard; what this rank
    saved loads back on the same rank of the same layout.
    The saved tensors are copies, not views of the parameters.
    """

    _comet_block = None     # the owning CometMoEBlock (a plain attribute, not a child)

    def __init__(self, cfg: MoEConfig, w13: torch.Tensor, w2: torch.Tensor,
                 layout: ExpertLayout, first_expert: int, requires_grad: bool = True,
                 b13: torch.Tensor | None = None, b2: torch.Tensor | None = None,
                 ffn_cols: range | None = None, adds_b2: bool = True):
        super().__init__(cfg, w13.shape[0], device="meta", ffn_shard=w2.shape[1],
                         adds_b2=adds_b2)
        self.w13 = nn.Parameter(w13, requires_grad=requires_grad)
        self.w2 = nn.Parameter(w2, requires_grad=requires_grad)
        if cfg.expert_bias:
            self.b13 = nn.Parameter(b13, requires_grad=requires_grad)
            self.b2 = nn.Parameter(b2, requires_grad=requires_grad)
        self.layout = layout
        self.num_experts = cfg.num_experts
        self.first_expert = first_expert
        self.ffn = cfg.intermediate_size
        self.ffn_cols = range(self.ffn) if ffn_cols is None else ffn_cols

    def extra_repr(self) -> str:
        el, cols = self.w13.shape[0], self.ffn_cols
        shard = f", F columns [{cols.start}, {cols.stop}) of {self.ffn}" if self.ffn_sharded else ""
        return (f"experts [{self.first_expert}, {self.first_expert + el}) of {self.num_experts}"
                f"{shard}, checkpoint layout={self.layout.kind}")

    @property
    def ffn_sharded(self) -> bool:
        """These experts hold a TP shard of the F columns, not all of them."""
        return len(self.ffn_cols) != self.ffn

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor | None = None,
                top_k_weights: torch.Tensor | None = None) -> torch.Tensor:
        """The replaced experts module's call, computed by comet (see the class doc)."""
        return _call_block(self, hidden_states, top_k_index, top_k_weights)

    # ------------------------------------------------------------------ saving
    def _checkpoint_entries(self, w13: torch.Tensor, w2: torch.Tensor, b13: torch.Tensor | None,
                            b2: torch.Tensor | None) -> dict[str, torch.Tensor]:
        """This rank's experts under the replaced module's keys, in its layout."""
        layout = self.layout
        w13 = gate_up_first(w13)   # checkpoints keep the models' layout
        b13 = None if b13 is None else gate_up_first(b13)
        if layout.kind == "fused":
            gate_up = _models_order(w13, layout.gate_up)
            out = ({"gate_up_proj": gate_up} if layout.transposed
                   else {"gate_up_proj": gate_up.transpose(1, 2).contiguous()})
            if layout.biases & {"gate", "up"}:
                out["gate_up_proj_bias"] = _models_order(b13, layout.gate_up)
            out["down_proj"] = (w2.clone() if layout.transposed
                                else w2.transpose(1, 2).contiguous())
            if "down" in layout.biases:
                out["down_proj_bias"] = b2.clone()
            return out
        if layout.kind == "stacked":
            gate, up, down = _kernel_to_stacked(w13, w2)   # gate, up: new (w13 is a copy)
            return dict(zip(layout.names, (gate.contiguous(), up.contiguous(), down.clone())))
        f = w2.shape[1]
        out = {}
        for i in range(w13.shape[0]):
            e = self.first_expert + i
            weights = (w13[i, :, :f].t(), w13[i, :, f:].t(), w2[i].t())
            biases = (None, None, None) if b13 is None else (b13[i, :f], b13[i, f:], b2[i])
            for part, name, weight, bias in zip(_PARTS, layout.names, weights, biases):
                out[f"{e}.{name}.weight"] = weight.contiguous()
                if part in layout.biases:
                    out[f"{e}.{name}.bias"] = bias.clone()
        return out

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        params = (self.w13, self.w2, self.b13, self.b2)
        if not keep_vars:
            params = tuple(None if p is None else p.detach() for p in params)
        for key, value in self._checkpoint_entries(*params).items():
            destination[prefix + key] = value

    # ------------------------------------------------------------------ loading
    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict,
                              missing_keys, unexpected_keys, error_msgs):
        if prefix + "w13" not in state_dict and prefix + "w2" not in state_dict:
            self._translate_checkpoint(state_dict, prefix, missing_keys, unexpected_keys,
                                       error_msgs)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict,
                                      missing_keys, unexpected_keys, error_msgs)

    def _translate_checkpoint(self, state_dict, prefix, missing_keys, unexpected_keys,
                              error_msgs) -> None:
        """Replace transformers expert keys under ``prefix`` by ``w13``/``w2`` (and
        ``b13``/``b2``) entries.

        The checkpoint is read into this rank's tensors in the gate-then-up layout
        (``cur``), interleaved at the end. Anything this rank lacks is reported under the
        transformers key names, and the current values stand in so torch does not report
        ``w13``/``w2`` a second time. Bias keys are taken only by experts with biases (to
        others they are unexpected, as to the replaced module).
        """
        cur = {"w13": gate_up_first(self.w13.detach()), "w2": self.w2.detach().clone()}
        if self.b13 is not None:
            cur.update(b13=gate_up_first(self.b13.detach()), b2=self.b2.detach().clone())
        fused_keys = _FUSED_KEYS + (tuple(_FUSED_BIASES) if self.b13 is not None else ())
        fused = {k: state_dict.pop(prefix + k) for k in fused_keys if prefix + k in state_dict}
        stacked_keys = self.layout.names if self.layout.kind == "stacked" else ()
        stacked = {k: state_dict.pop(prefix + k) for k in stacked_keys
                   if prefix + k in state_dict}
        linear = {}
        kinds = "weight|bias" if self.b13 is not None else "weight"
        pattern = re.compile(re.escape(prefix) + rf"(\d+)\.(\w+)\.({kinds})$")
        for key in [k for k in state_dict if k.startswith(prefix)]:
            m = pattern.match(key)
            if m and any(m.group(2) in names for names in _LINEAR_NAMES):
                linear[(int(m.group(1)), m.group(2), m.group(3))] = state_dict.pop(key)
        found = fused or stacked or linear
        if not found and self.layout.kind == "fused":
            missing_keys.extend(prefix + k for k in self._wanted_fused_keys())
        if fused:
            self._load_fused(fused, cur, prefix, missing_keys, error_msgs)
        if stacked or not found and self.layout.kind == "stacked":
            self._load_stacked(stacked, cur, prefix, missing_keys, error_msgs)
        if linear or not found and self.layout.kind == "linear":
            self._load_linear(linear, cur, prefix, missing_keys, unexpected_keys)
        for name, value in cur.items():
            interleaved = name in ("w13", "b13")
            state_dict[prefix + name] = interleave_gate_up(value) if interleaved else value

    def _wanted_fused_keys(self) -> list[str]:
        """The fused keys a checkpoint of these experts has: weights, and the biases of
        the projections that carry one."""
        biases = self.layout.biases if self.b13 is not None else frozenset()
        return list(_FUSED_KEYS) + [k for k, parts in _FUSED_BIASES.items()
                                    if biases & set(parts)]

    def _fused_format(self) -> ExpertLayout:
        """How fused checkpoint tensors are laid out: as this module's own when it was
        fused, else transformers 5.x's default (``[E, 2F, H]``, concatenated)."""
        return self.layout if self.layout.kind == "fused" else ExpertLayout("fused")

    def _this_ranks(self, key: str, value: torch.Tensor, prefix: str, error_msgs,
                    ffn_rows: bool = False) -> torch.Tensor | None:
        """This rank's part of a checkpoint tensor whose leading dimension holds its
        experts (with ``ffn_rows``: ``F`` rows of each, stacked): of a full tensor (``E``,
        or ``E*F`` rows), this rank's experts -- and of their rows its F shard --; one of
        this rank's size (``El``, or ``El*Ft`` rows) is its own shard as saved by
        ``state_dict()`` on the same rank of the same layout. Anything else is reported
        (None)."""
        el, lo = self.w13.shape[0], self.first_expert
        f, ft = (self.ffn, len(self.ffn_cols)) if ffn_rows else (1, 1)
        rows = value.shape[0] if value.dim() else 0
        if rows == self.num_experts * f:
            part = value[lo * f:(lo + el) * f]
            if ft != f:
                part = ffn_columns(part.unflatten(0, (el, f)), 1, self.ffn_cols).flatten(0, 1)
            return part
        if rows == el * ft:
            return value
        unit = "experts" if f == 1 else f"rows ({f} an expert)"
        error_msgs.append(
            f"size mismatch for {prefix}{key}: {rows} {unit} in the checkpoint, expected "
            f"{self.num_experts * f} (all) or {el * ft} (this rank's shard)")
        return None

    def _ffn_shard(self, t: torch.Tensor, dim: int, gate_up: bool = False) -> torch.Tensor:
        """This rank's F shard of a checkpoint tensor along ``dim`` where it has every F
        column (with ``gate_up``: of each gate-then-up half); else ``t`` itself -- this
        rank's shard as saved, or a size mismatch the copy reports."""
        if not self.ffn_sharded or t.shape[dim] != (2 if gate_up else 1) * self.ffn:
            return t
        return ffn_columns(t, dim, self.ffn_cols, gate_up)

    def _load_fused(self, fused, cur, prefix, missing_keys, error_msgs) -> None:
        missing_keys.extend(prefix + k for k in self._wanted_fused_keys() if k not in fused)
        shard = {k: self._this_ranks(k, v, prefix, error_msgs) for k, v in fused.items()}
        shard = {k: v for k, v in shard.items() if v is not None}
        fmt = self._fused_format()
        if "gate_up_proj" in shard and "down_proj" in shard:
            new13, new2 = _fused_to_kernel(shard["gate_up_proj"], shard["down_proj"], fmt)
            new13, new2 = self._ffn_shard(new13, -1, gate_up=True), self._ffn_shard(new2, 1)
            self._copy(cur, {"w13": new13, "w2": new2}, f"{prefix}gate_up_proj/down_proj",
                       error_msgs)
        if "gate_up_proj_bias" in shard:
            b13 = _gate_then_up(shard["gate_up_proj_bias"], fmt.gate_up)
            self._copy(cur, {"b13": self._ffn_shard(b13, -1, gate_up=True)},
                       f"{prefix}gate_up_proj_bias", error_msgs)
        if "down_proj_bias" in shard:
            self._copy(cur, {"b2": shard["down_proj_bias"]}, f"{prefix}down_proj_bias",
                       error_msgs)

    def _load_stacked(self, stacked, cur, prefix, missing_keys, error_msgs) -> None:
        """Stacked ``[E*F, H]`` (or this rank's ``[El*Ft, H]``) gate, up and down tensors
        under the layout's paths."""
        names, (_, f, h) = self.layout.names, cur["w2"].shape
        missing_keys.extend(prefix + n for n in names if n not in stacked)
        shard = {}
        for name, value in stacked.items():
            part = self._this_ranks(name, value, prefix, error_msgs, ffn_rows=True)
            if part is not None and (part.dim() != 2 or part.shape[1] != h):
                error_msgs.append(f"size mismatch for {prefix}{name}: checkpoint gives "
                                  f"{tuple(value.shape)}, the layer has [E*F, H] with H = {h}")
            elif part is not None:
                shard[name] = part
        if len(shard) == len(names):
            new13, new2 = _stacked_to_kernel(*(shard[n] for n in names), f)
            self._copy(cur, {"w13": new13, "w2": new2}, prefix + "/".join(names), error_msgs)

    @staticmethod
    def _copy(cur, new, what, error_msgs) -> None:
        """Copy ``new`` into ``cur`` (same keys) when every shape fits, else report."""
        if any(new[k].shape != cur[k].shape for k in new):
            error_msgs.append(
                f"size mismatch for {what}: checkpoint gives "
                f"{'/'.join(str(tuple(v.shape)) for v in new.values())} in the reference "
                f"layout, the layer has {'/'.join(str(tuple(cur[k].shape)) for k in new)}")
            return
        for k, v in new.items():
            cur[k].copy_(v)

    def _load_linear(self, linear, cur, prefix, missing_keys, unexpected_keys) -> None:
        el, lo, f = cur["w13"].shape[0], self.first_expert, cur["w2"].shape[1]
        names = self.layout.names
        if linear and not any(n in names for _, n, _ in linear):
            names = next(ns for ns in _LINEAR_NAMES if any(n in ns for _, n, _ in linear))
        for (e, n, kind) in linear:
            if e >= self.num_experts or n not in names:
                unexpected_keys.append(f"{prefix}{e}.{n}.{kind}")
        biased = self.layout.biases if self.b13 is not None else frozenset()
        for i in range(el):
            e = lo + i
            wanted = [(e, n, "weight") for n in names] + [
                (e, n, "bias") for part, n in zip(_PARTS, names) if part in biased]
            missing_keys.extend(f"{prefix}{e}.{n}.{kind}" for e, n, kind in wanted
                                if (e, n, kind) not in linear)
            if all((e, n, "weight") in linear for n in names):
                a, b = _linear_to_kernel(*(linear[(e, n, "weight")] for n in names))
                cur["w13"][i].copy_(self._ffn_shard(a, -1, gate_up=True))
                cur["w2"][i].copy_(self._ffn_shard(b, 0))
            if self.b13 is not None:
                slots = (cur["b13"][i, :f], cur["b13"][i, f:], cur["b2"][i])
                for part, n, slot in zip(_PARTS, names, slots):
                    if (e, n, "bias") in linear:
                        bias = linear[(e, n, "bias")]
                        slot.copy_(bias if part == "down" else self._ffn_shard(bias, 0))


#: The tensors of fused FP8 experts, in the checkpoint's names.
_FP8_KEYS = ("gate_up_proj", "gate_up_proj_scale_inv", "down_proj", "down_proj_scale_inv")


class Fp8TransformersExperts(nn.Module):
    """This rank's FP8 experts as the FP8 checkpoint holds them, under its keys:
    ``gate_up_proj`` e4m3 ``[El, 2F, H]`` (gate rows, then up rows), ``down_proj`` e4m3
    ``[El, H, F]``, ``gate_up_proj_scale_inv`` / ``down_proj_scale_inv`` in the
    checkpoint's dtype (fp32 or UE8M0) -- the replaced ``FP8Experts``' own tensors on a
    single expert-parallel rank, a copy of this rank's ``El`` experts otherwise (so the
    others' memory is freed). :meth:`fp8_weights` hands them to the layer as
    :class:`comet.quant.Fp8Weight` (UE8M0 scales as fp32). Forward only; no biases.

    Called as the replaced module was (``experts(hidden [T, H], top_k_index [T, k],
    top_k_weights [T, k]) -> [T, H]``), it runs the experts on comet through the block
    that owns it. ``state_dict()`` writes this rank's tensors; ``load_state_dict()`` takes
    this rank's or the full ``[E, ...]`` ones (sliced to this rank).
    """

    _comet_block = None     # the owning CometMoEBlock (a plain attribute, not a child)
    b13 = b2 = added_b2 = None    # FP8 experts have no biases
    SLOT_NAMES = _FP8_KEYS          # as LocalExperts' (comet.eplb)

    def __init__(self, cfg: MoEConfig, experts: nn.Module, fp8: Fp8Checkpoint,
                 first_expert: int, local_experts: int):
        super().__init__()
        self.num_experts = cfg.num_experts
        self.first_expert = first_expert
        self.fp8 = fp8
        self.ffn = cfg.intermediate_size
        whole = local_experts == self.num_experts
        for name in _FP8_KEYS:
            value = getattr(experts, name).detach()
            if not whole:
                value = value[first_expert:first_expert + local_experts].clone()
            self.register_parameter(name, nn.Parameter(value, requires_grad=False))

    @property
    def w13(self) -> torch.Tensor:
        """The layer's ``w13``: ``gate_up_proj`` (its dtype, device and ``requires_grad``
        are what :class:`comet.CometMoE` reads)."""
        return self.gate_up_proj

    @property
    def w2(self) -> torch.Tensor:
        return self.down_proj

    def _apply(self, fn, recurse=True):
        return super()._apply(device_only(fn), recurse)   # .to(dtype) keeps them FP8

    def fp8_weights(self) -> tuple[Fp8Weight, Fp8Weight]:
        """``(gate_up, down)`` as the FP8 layer takes them."""
        h = self.down_proj.shape[1]
        return fp8_experts(self.gate_up_proj, self.down_proj, self.gate_up_proj.shape[0], h,
                           self.ffn, self.fp8.blocks, self.gate_up_proj_scale_inv,
                           self.down_proj_scale_inv)

    def extra_repr(self) -> str:
        el = self.gate_up_proj.shape[0]
        return (f"experts [{self.first_expert}, {self.first_expert + el}) of "
                f"{self.num_experts}, FP8 {self.fp8.blocks.n}x{self.fp8.blocks.k} blocks, "
                f"scales {self.fp8.scale_dtype}")

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor | None = None,
                top_k_weights: torch.Tensor | None = None) -> torch.Tensor:
        """The replaced experts module's call, computed by comet (see the class doc)."""
        return _call_block(self, hidden_states, top_k_index, top_k_weights)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict,
                              missing_keys, unexpected_keys, error_msgs):
        el, lo = self.gate_up_proj.shape[0], self.first_expert
        for name in _FP8_KEYS:
            value = state_dict.get(prefix + name)
            if (isinstance(value, torch.Tensor) and value.dim() and el != self.num_experts
                    and value.shape[0] == self.num_experts):
                state_dict[prefix + name] = value[lo:lo + el]
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict,
                                      missing_keys, unexpected_keys, error_msgs)
        if self._comet_block is not None:     # its fused layer may hold fp32 copies of
            self._comet_block._fused = None   # UE8M0 scales: rebuilt on first use
