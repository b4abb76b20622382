"""Megatron module specs that build comet's MoE layer.

Megatron builds a model from specs: a layer spec names the modules of one transformer
layer, and its ``mlp`` entry, for an MoE layer, names ``MoELayer`` with its router, expert
and shared-expert submodules. comet's specs are Megatron's own with two substitutions --
``MoELayer`` -> :class:`~comet.integrations.megatron.layer.CometMoELayer` and the experts
-> :class:`~comet.integrations.megatron.experts.CometExperts` -- so that attention, norms,
router and shared experts stay whatever the Megatron spec function chose (local or
TransformerEngine modules):

* :func:`use_comet` rewrites any spec (a layer spec, a decoder block spec with dense and
  MoE layers, an MoE module spec, an MTP block spec);
* :func:`get_comet_moe_module_spec` mirrors Megatron's ``get_moe_module_spec``;
* :func:`get_gpt_layer_comet_spec` is Megatron's GPT layer spec (TransformerEngine's
  where it is installed, else the local one) with comet's MoE layer;
* :data:`gpt_layer_spec` is that spec as a module attribute, for Megatron-LM's
  ``--spec comet.integrations.megatron.specs gpt_layer_spec`` (``max_tokens`` then comes
  from the first call: :class:`~comet.integrations.megatron.experts.CometExperts`).

The comet arguments (``max_tokens``, ``comm_blocks``, ``tuned_config_folder``,
``fused_backward``, ``tile``) become the experts' spec params.
"""

from __future__ import annotations

import dataclasses
import functools

from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.spec_utils import ModuleSpec

from comet.integrations.megatron.experts import CometExperts
from comet.integrations.megatron.layer import CometMoELayer

#: The keyword arguments comet's specs pass to :class:`CometExperts`.
COMET_ARGS = ("max_tokens", "comm_blocks", "tuned_config_folder", "fused_backward", "tile")


def _have_te() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


def _is_moe(spec) -> bool:
    """A spec that builds Megatron's ``MoELayer`` (a ModuleSpec, or a partial as newer
    Megatron writes them)."""
    module = (spec.module if isinstance(spec, ModuleSpec)
              else spec.func if isinstance(spec, functools.partial) else None)
    return isinstance(module, type) and issubclass(module, MoELayer)


def _comet_moe(spec, comet: dict) -> ModuleSpec:
    """The comet MoE spec replacing Megatron's MoE spec ``spec``: same router and shared
    experts, comet's layer and experts."""
    if isinstance(spec, ModuleSpec):
        submodules, metainfo = spec.submodules, dict(spec.metainfo)
        params = dict(spec.params)
    else:
        submodules, metainfo = spec.keywords["submodules"], {}
        params = {k: v for k, v in spec.keywords.items() if k != "submodules"}
    experts = ModuleSpec(module=CometExperts, params=dict(comet))
    return ModuleSpec(module=CometMoELayer, params=params, metainfo=metainfo,
                      submodules=dataclasses.replace(submodules, experts=experts))


def _rewrite(spec, comet: dict):
    """``spec`` with its MoE specs replaced; the object itself where nothing in it is."""
    if _is_moe(spec):
        return _comet_moe(spec, comet)
    if isinstance(spec, functools.partial):
        kw = {k: _rewrite(v, comet) for k, v in spec.keywords.items()}
        if all(kw[k] is v for k, v in spec.keywords.items()):
            return spec
        return functools.partial(spec.func, *spec.args, **kw)
    if dataclasses.is_dataclass(spec) and not isinstance(spec, type):   # ModuleSpec too
        fields = [f.name for f in dataclasses.fields(spec) if f.init]
        changes = {n: _rewrite(getattr(spec, n), comet) for n in fields}
        changed = {n: v for n, v in changes.items() if v is not getattr(spec, n)}
        return dataclasses.replace(spec, **changed) if changed else spec
    if isinstance(spec, (list, tuple)):
        items = [_rewrite(s, comet) for s in spec]
        if all(a is b for a, b in zip(items, spec)):
            return spec
        return type(spec)(items)
    return spec


def use_comet(spec, *, max_tokens: int | None = None,
              comm_blocks: int | tuple[int, int] | None = None,
              tuned_config_folder: str | None = None, fused_backward: bool = True,
              tile=None):
    """``spec`` (any Megatron spec: layer, decoder block, MoE module, MTP block) with every
    MoE layer in it built by comet: ``CometMoELayer`` with ``CometExperts``, the router
    and shared experts of ``spec`` unchanged. Other entries are returned as they were
    (the input is not modified). Keyword arguments: :class:`CometExperts`'."""
    comet = dict(max_tokens=max_tokens, comm_blocks=comm_blocks,
                 tuned_config_folder=tuned_config_folder, fused_backward=fused_backward,
                 tile=tile)
    return _rewrite(spec, comet)


def get_comet_moe_module_spec(num_experts: int | None = None, use_te: bool | None = None,
                              **comet) -> ModuleSpec:
    """Megatron's ``get_moe_module_spec(use_te, num_experts)`` with comet's layer and
    experts (:func:`use_comet`; ``comet``: its keyword arguments). ``use_te`` None:
    TransformerEngine's shared-expert linears where it is installed."""
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    use_te = _have_te() if use_te is None else use_te
    return use_comet(get_moe_module_spec(use_te=use_te, num_experts=num_experts or 1),
                     **comet)


def get_gpt_layer_comet_spec(num_experts: int | None = None, use_te: bool | None = None,
                             *, layer_args: dict | None = None, **comet) -> ModuleSpec:
    """Megatron's GPT layer spec -- ``get_gpt_layer_with_transformer_engine_spec`` where
    TransformerEngine is installed (or ``use_te``), else ``get_gpt_layer_local_spec`` --
    with an MoE layer built by comet. ``layer_args``: the Megatron function's other
    keyword arguments (``qk_layernorm``, ``multi_latent_attention``, ...);
    ``comet``: :func:`use_comet`'s."""
    from megatron.core.models.gpt import gpt_layer_specs
    use_te = _have_te() if use_te is None else use_te
    make = (gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec if use_te
            else gpt_layer_specs.get_gpt_layer_local_spec)
    spec = make(num_experts=num_experts or 1, moe_grouped_gemm=False, **(layer_args or {}))
    return use_comet(spec, **comet)


#: :func:`get_gpt_layer_comet_spec` with its defaults, loadable by Megatron-LM's
#: ``--spec comet.integrations.megatron.specs gpt_layer_spec``.
gpt_layer_spec = get_gpt_layer_comet_spec()
