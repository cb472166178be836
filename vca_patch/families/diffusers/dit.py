"""Diffusion transformers in diffusers (0.42 layout): DiT, PixArt-α/Σ, SD3/SD3.5 and Flux.

Every `Attention` / `AttentionModuleMixin` module is classified:

- **image self-attention** (DiT `attn1`, PixArt `attn1`, SD3.5 `attn2`): converted. The token grid comes from the
  patch embedding's input latent (H/p × W/p, any resolution and aspect ratio); no prefix tokens.
- **joint attention** (image + text: SD3/SD3.5 `attn`, `JointAttnProcessor2_0`): converted to
  `JointVisualContrastAttention`; the text tokens are exact prefix tokens (they read all keys with softmax
  attention, so the text stream's output is the original's; linear in N since the text length is fixed) and
  keys of the image tokens. Flux double-stream blocks (`FluxAttnProcessor`, text first) likewise, with the rotary
  embedding kept on every query and key (contrast tokens as `VCAConfig.rope_contrast` says). Flux single-stream
  blocks (one [text; image] sequence, shared q/k/v, no output projection) convert to
  `SingleStreamVisualContrastAttention`, text first as exact prefix tokens; their block indices continue after
  the double-stream blocks' (λ_init and `layers=` count on). Flux has no patch embedding: its grid comes from
  `img_ids` (`diffusers_flux`).
- **cross-attention** (PixArt `attn2`, image → text): skipped; it already costs N·L, linear in N.
- **already linear** (Sana's ReLU linear attention) and **unknown processors** (IP-Adapter, PAG, fused
  projections, custom): skipped, with the processor named.

A site is converted by swapping its processor (`processor.CarriedLayerProcessor`), so `to_q/to_k/to_v/to_out` keep
their state-dict names and `unpatch_model` puts the original processor object back; the replacement's new parameters
live in a child of the attention module named for the target (`attn.vca.…`, `attn.mano.…`: `processor.holder_name`).
diffusers is imported only when a diffusers model is seen (optional extra `vca-patch[diffusers]`).
"""

from __future__ import annotations

import re
from typing import Any

from torch import nn

from vca_patch.families.base import (
    AttentionSite,
    LayoutScopeEnd,
    LayoutTracker,
    ModelAdapter,
    SkippedSite,
    remove_hooks,
)
from vca_patch.families.diffusers import probe
from vca_patch.families.diffusers.flux import (
    FluxJointLayerProcessor,
    FluxLayoutHook,
    FluxSingleLayerProcessor,
    flux_verification_error,
    is_flux,
    single_verification_error,
)
from vca_patch.families.diffusers.guard import ARCHITECTURES, check_diffusers_base
from vca_patch.families.diffusers.joint import carry_joint, joint_structure_problem, joint_verification_error
from vca_patch.families.diffusers.library import DIFFUSERS
from vca_patch.families.diffusers.processor import (
    CarriedLayerProcessor,
    JointLayerProcessor,
    holder_name,
    new_members,
)
from vca_patch.families.diffusers.source import SOURCE
from vca_patch.families.verify import TOLERANCE
from vca_patch.layers.carried import CarriedAttention
from vca_patch.layers.fused_qkv import SplitQKV
from vca_patch.layers.joint_carry import CarriedSingleStreamAttention, NoOutputProjection
from vca_patch.layers.layout import TokenLayout

# Model classes whose patched form `create_base` rebuilds from their diffusers config.
# Processors computing plain softmax attention over `to_q/to_k/to_v` (JointAttnProcessor2_0: only without
# added text projections, where it is SD3.5's image-only self-attention).
_SOFTMAX_PROCESSORS = ("AttnProcessor2_0", "AttnProcessor", "JointAttnProcessor2_0")
_JOINT_PROCESSORS = ("JointAttnProcessor2_0", "FluxAttnProcessor")
_LINEAR_PROCESSORS = (
    "SanaLinearAttnProcessor2_0",
    "PAGCFGSanaLinearAttnProcessor2_0",
    "PAGIdentitySanaLinearAttnProcessor2_0",
)
_BLOCK_INDEX = re.compile(r"(?:^|\.)(?:single_)?transformer_blocks\.(\d+)\.")
_QKV = ("to_q", "to_k", "to_v")


def _attention_types() -> tuple[type, ...]:
    from diffusers.models.attention import AttentionModuleMixin
    from diffusers.models.attention_processor import Attention

    return Attention, AttentionModuleMixin


def _patch_embedding(model: nn.Module) -> nn.Module | None:
    """The model's diffusers `PatchEmbed` (latent [B, C, H, W] -> tokens), a direct child; else None."""
    from diffusers.models.embeddings import PatchEmbed

    return next((m for m in model.children() if isinstance(m, PatchEmbed)), None)


def _grid(conv: nn.Conv2d, height: int, width: int) -> tuple[int, int]:
    (kh, kw), (sh, sw) = conv.kernel_size, conv.stride
    return (height - kh) // sh + 1, (width - kw) // sw + 1


def classify(module: nn.Module) -> tuple[str, str | None]:
    """(kind, why it is skipped or None) of a diffusers attention module; kind is "self", "joint", "cross",
    "linear" or "unknown"."""
    processor = getattr(module, "processor", None)
    name = type(processor).__name__
    where = f"{type(processor).__module__}.{name}"
    if name in _LINEAR_PROCESSORS:
        return "linear", f"already linear attention ({name}): nothing to convert"
    joint = getattr(module, "added_kv_proj_dim", None) is not None or getattr(module, "add_q_proj", None) is not None
    if name == "FluxAttnProcessor" and not joint:
        return ("single", None) if _single_stream(module) else ("unknown", "Flux attention without added text "
                "projections that is not single-stream (pre_only, shared to_q/to_k/to_v, RMSNorm q/k)")  # fmt: skip
    if joint and name not in _JOINT_PROCESSORS:
        return "unknown", (
            f"joint (image + text) attention with processor {where}: only JointAttnProcessor2_0 (SD3/SD3.5) and "
            "FluxAttnProcessor are converted; call model.set_default_attn_processor() first if it is a plain "
            "softmax processor"
        )
    if not joint and (getattr(module, "is_cross_attention", False) or getattr(module, "only_cross_attention", False)):
        return "cross", "cross-attention (image -> text, already O(N·L)): left as it is"
    if not joint and name not in _SOFTMAX_PROCESSORS:
        return "unknown", (
            f"unknown attention processor {where} (IP-Adapter, PAG, fused projections or custom): not converted; "
            "call model.set_default_attn_processor() first if it is a plain softmax processor"
        )
    projections = [getattr(module, n, None) for n in _QKV]
    to_out = getattr(module, "to_out", None)
    if not all(isinstance(p, nn.Linear) for p in projections) or not isinstance(to_out, nn.ModuleList):
        return "unknown", "expected to_q/to_k/to_v Linear layers and a to_out list"
    if not isinstance(to_out[0], nn.Linear) or len({p.out_features for p in projections}) != 1:
        return "unknown", "to_out[0] is not a Linear, or q/k/v widths differ (grouped-query attention)"
    unsupported = [
        label
        for label, on in (
            ("spatial_norm", getattr(module, "spatial_norm", None) is not None),
            ("group_norm", getattr(module, "group_norm", None) is not None),
            ("residual_connection", bool(getattr(module, "residual_connection", False))),
            ("rescale_output_factor", getattr(module, "rescale_output_factor", 1.0) != 1.0),
        )
        if on
    ]
    if unsupported:
        return "unknown", f"attention options the VCA processor does not apply: {', '.join(unsupported)}"
    if joint:
        problem = joint_structure_problem(module)
        return ("unknown", f"joint attention: {problem}") if problem else ("joint", None)
    return "self", None


def _single_stream(module: nn.Module) -> bool:
    """A Flux single-stream attention: to_q/to_k/to_v Linear layers of one width, no output projection."""
    projections = [getattr(module, n, None) for n in _QKV]
    if not all(isinstance(p, nn.Linear) for p in projections) or len({p.out_features for p in projections}) != 1:
        return False
    return bool(getattr(module, "pre_only", False)) and getattr(module, "to_out", None) is None


KINDS = {  # classify()'s kinds, as `inspect` names them
    "self": "image self-attention",
    "joint": "joint attention (image + text)",
    "single": "single-stream joint attention (text + image)",
    "cross": "cross-attention (image -> text)",
    "linear": "linear attention",
    "unknown": "unknown processor",
}


class DiffusersDiTAdapter(ModelAdapter):
    """Converts the image self-attention of diffusers diffusion transformers by swapping attention processors."""

    name = "diffusers-dit"
    library = DIFFUSERS
    takes_images = False  # a random denoising step is its probe (`probe.probe_inputs`)
    sites_title = "Diffusion transformer attention"

    @classmethod
    def applies_to(cls, model: nn.Module) -> bool:
        if not type(model).__module__.startswith("diffusers."):
            return False
        return _patch_embedding(model) is not None or is_flux(model)

    # -- probing and measuring (the hooks `convert`, `inspect` and `train.params` call) ------------------------

    @classmethod
    def probe_inputs(cls, model: nn.Module, batch_size: int, seed: int) -> Any:
        """Keyword arguments of one random denoising step (latents, timesteps, conditions)."""
        return probe.probe_inputs(model, batch_size, seed)

    @classmethod
    def predict(cls, model: nn.Module, inputs: Any) -> Any:
        """The noise or velocity prediction on a denoising step's keyword arguments."""
        return probe.predict(model, inputs)

    @classmethod
    def probe_fidelity(
        cls, model: nn.Module, inputs: Any, prediction: dict[str, float], batch_size: int
    ) -> tuple[dict[str, float], str] | None:
        """Per-layer attention error against the original processors, and the prediction's error."""
        summary = probe.fidelity_summary(probe.attention_errors(model, inputs), prediction)
        return summary, f"{batch_size} random denoising inputs"

    @classmethod
    def describe_sites(cls, model: nn.Module) -> list[dict[str, str]]:
        """Each attention module's kind and the tokens it sees (module-level `describe_sites`)."""
        return describe_sites(model)

    @classmethod
    def new_parameters(cls, module: nn.Module) -> nn.Module | None:
        """The child that `install_replacement` added to a converted attention module (named for the target, as its
        processor records); None for a module this adapter did not convert."""
        processor = getattr(module, "processor", None)
        return module._modules.get(processor.holder) if isinstance(processor, CarriedLayerProcessor) else None

    def find_sites(self, model: nn.Module) -> tuple[list[AttentionSite], list[SkippedSite]]:
        attention_types = _attention_types()
        sites: list[AttentionSite] = []
        skipped: list[SkippedSite] = []
        double_blocks = len(getattr(model, "transformer_blocks", ()))  # single-stream block indices continue after
        for path, module in model.named_modules():
            if not isinstance(module, attention_types):
                continue
            _, reason = classify(module)
            match = _BLOCK_INDEX.search(path + ".")
            if reason is None and match is None:
                reason = "not inside a transformer block"
            if reason is not None:
                skipped.append(SkippedSite(path, type(module).__name__, reason))
                continue
            index = int(match.group(1)) + (double_blocks if path.startswith("single_transformer_blocks.") else 0)
            sites.append(AttentionSite(path, module, index, module.to_q.in_features, module.heads))
        return sites, skipped

    def embedding_module(self, model: nn.Module) -> nn.Module:
        return model.x_embedder if is_flux(model) else _patch_embedding(model)

    def install_layout_tracker(self, model: nn.Module) -> LayoutTracker:
        """Patch-embedding models: the base hook on `pos_embed`. Flux: a pre-hook reading `img_ids`."""
        if not is_flux(model):
            return super().install_layout_tracker(model)
        tracker = LayoutTracker(self)
        model.register_forward_pre_hook(FluxLayoutHook(tracker), with_kwargs=True)
        model.register_forward_hook(LayoutScopeEnd(tracker), always_call=True)
        return tracker

    @staticmethod
    def remove_layout_tracker(model: nn.Module) -> None:
        ModelAdapter.remove_layout_tracker(model)
        remove_hooks(model, (FluxLayoutHook,), pre=True)

    def layout_from_embedding(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> TokenLayout:
        latent = args[0] if args else kwargs["latent"]
        grid = _grid(module.proj, *latent.shape[-2:])
        if output.shape[1] != grid[0] * grid[1]:
            raise ValueError(
                f"{type(module).__name__} gave {output.shape[1]} tokens for a {grid[0]}x{grid[1]} patch grid"
            )
        return TokenLayout(0, grid)

    def default_layout(self, model: nn.Module) -> TokenLayout | None:
        size = getattr(model.config, "sample_size", None)
        if size is None or is_flux(model):
            return None
        height, width = (size, size) if isinstance(size, int) else tuple(size)
        return TokenLayout(0, _grid(self.embedding_module(model).proj, height, width))

    def carry(self, site: AttentionSite) -> CarriedAttention:
        attn = site.module
        kind = classify(attn)[0]
        if kind == "joint":
            return carry_joint(attn)
        if kind == "single":
            return carry_single(attn)
        return CarriedAttention(
            qkv=SplitQKV(attn, _QKV),
            proj=attn.to_out[0],
            num_heads=attn.heads,
            head_dim=attn.to_q.out_features // attn.heads,
            q_norm=attn.norm_q if attn.norm_q is not None else nn.Identity(),
            k_norm=attn.norm_k if attn.norm_k is not None else nn.Identity(),
            proj_drop=attn.to_out[1] if len(attn.to_out) > 1 else nn.Identity(),
        )

    def verify(self, site: AttentionSite) -> AttentionSite:
        """Self-attention as for ViTs; joint attention: both output streams against a written-out reference."""
        kind = classify(site.module)[0]
        if kind not in ("joint", "single"):
            return super().verify(site)
        if kind == "single":
            error = single_verification_error(site.module, carry_single(site.module))
        else:
            flux = type(site.module.processor).__name__ == "FluxAttnProcessor"
            check = flux_verification_error if flux else joint_verification_error
            error = check(site.module, carry_joint(site.module))
        site.verified = None if error is None else error < TOLERANCE
        if site.verified is False:
            site.notes.append(f"reference joint softmax attention differs by {error:.2g} (relative)")
        return site

    def adapt_call(self, replacement: nn.Module, site: AttentionSite) -> None:
        """Nothing: the processor (`install_replacement`) speaks diffusers' call convention."""

    # -- processor swap (see surgery.patch: adapters that install replacements themselves) -------------------

    def install_replacement(self, model: nn.Module, path: str, layer: nn.Module, *, target: str | None = None) -> Any:
        """Make `layer` the processor of the attention at `path`, its new parameters in the child named for
        `target` (`holder_name`: `vca`, `mano`, ...); returns the original processor."""
        attn = model.get_submodule(path)
        holder = holder_name(target)
        if hasattr(attn, holder):
            raise ValueError(f"{path} already has {holder!r}: it cannot hold target {target!r}'s new parameters")
        sources = {name: name for name in _QKV}
        single = getattr(layer, "single_stream", False)  # no to_out: the layer keeps its own Identity
        if not single:
            sources[layer._proj_name] = "to_out.0"
        for member, source, present in (
            ("q_norm", "norm_q", attn.norm_q is not None),
            ("k_norm", "norm_k", attn.norm_k is not None),
            ("proj_drop", "to_out.1", not single and len(attn.to_out) > 1),
        ):
            if present:
                sources[member] = source
        processor_type = CarriedLayerProcessor
        if hasattr(layer, "stream_members"):  # a joint layer: per-stream norms under their own names
            sources.pop("q_norm", None)
            sources.pop("k_norm", None)
            sources.update({name: name for name in layer.stream_members()})
            processor_type = JointLayerProcessor
            if type(attn.processor).__name__ == "FluxAttnProcessor":
                processor_type = FluxSingleLayerProcessor if single else FluxJointLayerProcessor
                layer.__dict__["rotary_embed"] = model.pos_embed  # FluxPosEmbed (no tensors): centre rotations
        original = attn.processor
        attn.add_module(holder, new_members(layer, attn))
        attn.set_processor(processor_type(layer, sources, original, holder))
        return original

    def remove_replacement(self, model: nn.Module, path: str, original: Any) -> None:
        """Put the original processor object back and drop the new parameters (the holder the processor names)."""
        attn = model.get_submodule(path)
        processor = attn.processor
        attn.set_processor(original)
        if isinstance(processor, CarriedLayerProcessor):
            attn._modules.pop(processor.holder, None)

    # -- checkpoints ------------------------------------------------------------------------------------------

    def describe_base(self, model: nn.Module) -> dict[str, Any]:
        architecture = type(model).__name__
        if architecture not in ARCHITECTURES:
            raise ValueError(f"{architecture} cannot be saved by vca-patch yet; supported: {', '.join(ARCHITECTURES)}")
        config = {k: list(v) if isinstance(v, tuple) else v for k, v in model.config.items() if not k.startswith("_")}
        source = model.__dict__.get(SOURCE)  # set by diffusers_source when vca-patch loaded the model
        if source is None:
            name = model.config.get("_name_or_path", "") or None
            hub_id = name if name and re.fullmatch(r"[\w.-]+/[\w.-]+", name) else None
            source = {"hf_hub_id": hub_id, "subfolder": None, "revision": None}
        return {
            "library": "diffusers",
            "architecture": architecture,
            "config": config,
            **source,  # hf_hub_id, subfolder (transformer/ of a pipeline repo), revision (the commit it came from)
            "license": None,
        }

    @classmethod
    def create_base(cls, description: dict[str, Any]) -> nn.Module:
        check_diffusers_base(description, "create_base")
        import diffusers

        return getattr(diffusers, description["architecture"]).from_config(description["config"])


def carry_single(attn: nn.Module) -> CarriedSingleStreamAttention:
    """The modules of a Flux single-stream attention (no output projection: `NoOutputProjection`)."""
    return CarriedSingleStreamAttention(
        qkv=SplitQKV(attn, _QKV),
        proj=NoOutputProjection(attn.to_q.out_features),
        num_heads=attn.heads,
        head_dim=attn.to_q.out_features // attn.heads,
        q_norm=attn.norm_q if attn.norm_q is not None else nn.Identity(),
        k_norm=attn.norm_k if attn.norm_k is not None else nn.Identity(),
    )


def describe_sites(model: nn.Module) -> list[dict[str, str]]:
    """Per attention module of a diffusers transformer: its path, its kind (`KINDS`) and the token grid it runs on
    (the config's sample size through the patch embedding; any latent size runs), for `inspect`."""
    if is_flux(model):
        grid = "from img_ids (any size)"
    else:
        layout = DiffusersDiTAdapter().default_layout(model)
        grid = f"{layout.grid[0]}x{layout.grid[1]} at sample_size (any size)" if layout else "from the latent"
    rows = []
    for path, module in model.named_modules():
        if isinstance(module, _attention_types()):
            kind = classify(module)[0]
            text = "+ text tokens" if kind in ("joint", "single") else ""
            order = "text first" if kind == "single" or (kind == "joint" and is_flux(model)) else "image first"
            tokens = f"{grid} {text} ({order})" if text else (grid if kind in ("self", "linear") else "-")
            rows.append({"module": path, "kind": KINDS[kind], "tokens": tokens})
    return rows


def patched_processors(model: nn.Module) -> dict[str, CarriedLayerProcessor]:
    """Attention path -> its vca_patch processor, for a diffusers model patched by this adapter."""
    return {
        path: m.processor
        for path, m in model.named_modules()
        if isinstance(getattr(m, "processor", None), CarriedLayerProcessor)
    }
