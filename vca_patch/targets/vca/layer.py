"""Visual-Contrast Attention (VCA; Pu et al., NeurIPS 2025, arXiv 2511.00833).

Linear-cost attention through n pooled "contrast tokens" and a positive/negative differential:

    t̃      = avgpool_{h×w}(q[patches])                        pooled queries        [B, n, C]
    t±     = t̃ + e±                                           dual embeddings       [B, n, C]
    v̂      = (1−λ_init)·RMSNorm₁(softmax(s t₊kᵀ)v − λ₁·softmax(s t₋kᵀ)v)   Stage I  [B, M, n, d]
    o      = (1−λ_init)·RMSNorm₂((A₊ − λ₂·A₋)·v̂)               Stage II              [B, M, N, d]
    y      = proj(merge_heads(o) + DWC₃ₓ₃(v[patches]))

With `local_window=k` the patch rows also read their k×k neighbourhood (`neighbourhood_attention`), mixed per
channel: o = α⊙o on Stage II's rows, + β⊙NA_k(q, k, v) on the patch rows, with α = 1, β = 0 at init (the layer
above).

Prefix tokens (CLS, distillation, registers) are keys in Stage I and queries in Stage II but are
never pooled and get no DWC term. Stage II uses one softmax over the 2n stacked tokens ("joint",
the official code) or two separate softmaxes ("separate", the paper text). This module knows
nothing about model libraries: adapters hand it q/k/v/proj and the token layout.

Two paths compute the same function: float32 inference on CPU runs everything between the projections
as one fused op (`fused_cpu`, `attend_fused`), eager or as one opaque call under `torch.compile` (its grid sizes
symbolic); training, GPUs, bf16/fp16, `torch.export`/ONNX (standard operators only) and machines without a C++
compiler run the composite path (`attend`: two SDPA calls and a few small ops).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from vca_patch.layers.carried import CarriedAttentionLayer, CarriedLayerOptions
from vca_patch.layers.fused_qkv import qkv_linears, qkv_projections, query_projection
from vca_patch.layers.grid_pool import adaptive_avg_pool_tokens
from vca_patch.layers.layout import TokenLayout
from vca_patch.layers.sdpa import scaled_dot_product_attention
from vca_patch.targets.vca import fused_cpu
from vca_patch.targets.vca.differential_lambda import DifferentialLambda, lambda_init_for_depth
from vca_patch.targets.vca.local_conv import add_conv_
from vca_patch.targets.vca.neighbourhood import is_local_window, neighbourhood_attention

if TYPE_CHECKING:
    from typing_extensions import Unpack

SoftmaxMode = Literal["joint", "separate"]
InitMode = Literal["preserve", "paper"]
PrefixReadout = Literal["contrast", "exact"]

# Pool the layer input (then project n rows) once the grid has this many patches per contrast token; below
# it, pooling the projected queries is cheaper (measured on CPU: the extra n×C×C projection dominates).
_POOL_INPUT_MIN_RATIO = 8


def _inverse_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """rsqrt(mean(x², -1) + eps) in at least float32: [..., d] -> [..., 1], one read of x."""
    dtype = torch.promote_types(x.dtype, torch.float32)
    norm = torch.linalg.vector_norm(x, 2, dim=-1, keepdim=True, dtype=dtype)
    return norm.square_().div_(x.shape[-1]).add_(eps).rsqrt_()


class _RMSNormFunction(torch.autograd.Function):
    """x·rstd·weight that saves only x and rstd (x̂ = x·rstd is recomputed in backward).

    Here x is always an SDPA output, which SDPA's backward keeps anyway, so the norm adds no activation.
    Three passes over x (norm, scale, weight) where the composite `F.rms_norm` takes six on CPU.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        rstd = _inverse_rms(x, eps)
        ctx.save_for_backward(x, rstd, weight)
        return (x * rstd).mul_(weight).to(x.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:
        x, rstd, weight = ctx.saved_tensors
        grad_x_hat = (x * rstd).mul_(grad)  # g·x̂, the one [.., d] temporary
        grad_weight = grad_x_hat.flatten(0, -2).sum(0) if ctx.needs_input_grad[1] else None
        dot = (grad_x_hat @ weight).unsqueeze(-1).mul_(rstd).div_(-x.shape[-1])  # −rstd·mean(g·w·x̂) over d
        # rstd·(g·w − x̂·mean(g·w·x̂)) = rstd·g·w + x·rstd·(−rstd·mean(g·w·x̂)), in the temporary's buffer.
        grad_x = grad_x_hat.copy_(grad).mul_(weight).addcmul_(x, dot).mul_(rstd)
        return grad_x.to(x.dtype), grad_weight, None


def _rms_norm(x: torch.Tensor, norm: nn.RMSNorm, scale: float = 1.0, *, inplace: bool = False) -> torch.Tensor:
    """scale·RMSNorm(x), computed in at least float32 (bf16/fp16 safe), returned in x's dtype.

    The scale is folded into the [d] weight, so it costs no pass over x. Without autograd and with
    `inplace`, x (a temporary of the caller's) is overwritten: two passes, no allocation.
    """
    weight = norm.weight.to(torch.promote_types(x.dtype, torch.float32)) * scale
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return _RMSNormFunction.apply(x, weight, norm.eps)
    rstd = _inverse_rms(x, norm.eps)
    return x.mul_(rstd).mul_(weight) if inplace else (x * rstd).mul_(weight).to(x.dtype)


def _patch_grid(x: torch.Tensor, layout: TokenLayout) -> torch.Tensor:
    """[B, M, N, d] per-head tokens -> [B, M*d, H, W] grid of the patch rows, channels-last strides.

    A view (no copy) when x is a head view of token rows ([B, N, k·M·d] projection outputs), so pooling and the
    depthwise conv run their channels-last kernels straight on the projection output.
    """
    B, M, _, d = x.shape
    H, W = layout.grid
    return x.transpose(1, 2)[:, layout.num_prefix_tokens :].reshape(B, H, W, M * d).permute(0, 3, 1, 2)


class VisualContrastAttention(CarriedAttentionLayer):
    """Multi-head Visual-Contrast Attention over `num_prefix_tokens + H·W` tokens.

    Args:
        dim: input channels.
        num_heads: heads M.
        head_dim: per-head width d (default dim // num_heads).
        dim_out: output channels (default dim).
        qkv, proj: existing fused q/k/v and output projections to reuse (built fresh when None).
            These, head_dim, dim_out, qkv_bias, proj_bias and proj_drop are `CarriedAttentionLayer`'s options.
        contrast_grid: (h, w) of the pooled contrast tokens, n = h·w.
        layer_index: 0-based block depth, sets λ_init = 0.8 − 0.6·exp(−0.3·layer_index).
        softmax: Stage-II softmax, "joint" over the 2n tokens or "separate" per stream.
        rms_eps: epsilon of both sub-layer RMSNorms.
        prefix_readout: "contrast" (the paper: prefix tokens read the contrast tokens in Stage II) or
            "exact" (prefix tokens read all N keys with plain softmax attention, O(N·P), no RMSNorm).
        stage2_temperature: add a learnable per-head factor τ on the Stage-II logits (s·τ·q·tᵀ),
            initialised to 1 (the exact paper form). Off: no extra parameter.
        token_magnitude: add a per-token, per-head output gain exp(W·x + b) on the Stage-II rows (RMSNorm₂ erases
            each token's magnitude; calibration fits W, b in closed form). Zero-initialised: gain 1, the paper form.
        local_window: k > 0 (odd) adds neighbourhood attention of each patch over its k×k patch neighbours and the
            prefix keys, mixed into the patch rows by per-channel scales (`global_scale` α on Stage II's output,
            init 1; `local_scale` β on the local term, init 0: the layer without it). 0: no local term.
    """

    def __init__(
        self,
        dim: int,
        num_heads: int,
        *,
        contrast_grid: tuple[int, int] = (7, 7),
        layer_index: int = 0,
        softmax: SoftmaxMode = "joint",
        rms_eps: float = 1e-5,
        prefix_readout: PrefixReadout = "contrast",
        stage2_temperature: bool = False,
        token_magnitude: bool = False,
        local_window: int = 0,
        **carried: Unpack[CarriedLayerOptions],
    ) -> None:
        if not is_local_window(local_window):
            raise ValueError(f"local_window must be 0 (off) or an odd kernel size (3, 5, 7, ...), got {local_window!r}")
        if softmax not in ("joint", "separate"):
            raise ValueError(f"softmax must be 'joint' or 'separate', got {softmax!r}")
        if prefix_readout not in ("contrast", "exact"):
            raise ValueError(f"prefix_readout must be 'contrast' or 'exact', got {prefix_readout!r}")
        if min(contrast_grid) < 1:
            raise ValueError(f"contrast_grid must be positive, got {contrast_grid}")
        super().__init__(dim, num_heads, **carried)
        head_dim, attn_dim = self.head_dim, self.attn_dim
        self.contrast_grid = tuple(contrast_grid)
        self.num_contrast_tokens = n = contrast_grid[0] * contrast_grid[1]
        self.layer_index = layer_index
        self.lambda_init = lambda_init_for_depth(layer_index)
        self.softmax = softmax
        self.prefix_readout = prefix_readout
        # Training: recompute everything after the q/k/v projection in backward (activation memory below softmax
        # attention's, for one more attention forward minus the qkv GEMM). Off: faster steps, more memory.
        self.recompute_in_backward = True

        # New VCA parameters (2nC + 10d + 10C), on the device and dtype of the carried weights.
        dd = self.factory_kwargs
        self.contrast_embed_pos = nn.Parameter(torch.zeros(1, n, attn_dim, **dd))
        self.contrast_embed_neg = nn.Parameter(torch.zeros(1, n, attn_dim, **dd))
        self.lambda1 = DifferentialLambda(head_dim, self.lambda_init, **dd)
        self.lambda2 = DifferentialLambda(head_dim, self.lambda_init, **dd)
        self.stage1_norm = nn.RMSNorm(head_dim, eps=rms_eps, **dd)
        self.stage2_norm = nn.RMSNorm(head_dim, eps=rms_eps, **dd)
        self.dwc = nn.Conv2d(attn_dim, attn_dim, 3, padding=1, groups=attn_dim, **dd)
        self.stage2_temperature = nn.Parameter(torch.ones(num_heads, **dd)) if stage2_temperature else None
        self.token_gain = nn.Linear(dim, num_heads, **dd) if token_magnitude else None  # log-gain per token and head
        self.local_window = local_window
        self.global_scale = nn.Parameter(torch.ones(attn_dim, **dd)) if local_window else None  # α [C]
        self.local_scale = nn.Parameter(torch.zeros(attn_dim, **dd)) if local_window else None  # β [C]
        self._kernel_arguments: tuple[tuple, tuple] | None = None  # (parameter versions, fused-kernel arguments)
        self._qkv_split: tuple[tuple, list] | None = None  # (parameter addresses, [(weight, bias)] of q, k, v)
        self.reset_vca_parameters("preserve")

    @torch.no_grad()
    def reset_vca_parameters(self, mode: InitMode = "preserve") -> None:
        """Initialise the parameters VCA adds (never qkv/proj).

        "paper": the from-scratch init (e± ~ N(0, 1), random λ vectors, default conv init).
        "preserve": e± = 0, λ₁ = λ₂ = 0 with live vectors, zero DWC, unit norms; the layer starts
        as an RMS-normalised pooled-query attention with the original q/k/v/proj.
        """
        self.stage1_norm.reset_parameters()
        self.stage2_norm.reset_parameters()
        if self.stage2_temperature is not None:
            self.stage2_temperature.fill_(1.0)
        if self.token_gain is not None:  # gain exp(0) = 1 in both modes
            self.token_gain.weight.zero_()
            self.token_gain.bias.zero_()
        if self.local_window:  # α = 1, β = 0: no local term, in both modes
            self.global_scale.fill_(1.0)
            self.local_scale.zero_()
        if mode == "paper":
            nn.init.normal_(self.contrast_embed_pos)
            nn.init.normal_(self.contrast_embed_neg)
            self.lambda1.reset_random()
            self.lambda2.reset_random()
            self.dwc.reset_parameters()
        elif mode == "preserve":
            self.contrast_embed_pos.zero_()
            self.contrast_embed_neg.zero_()
            self.lambda1.reset_to_zero_lambda()
            self.lambda2.reset_to_zero_lambda()
            self.dwc.weight.zero_()
            self.dwc.bias.zero_()
        else:
            raise ValueError(f"init mode must be 'preserve' or 'paper', got {mode!r}")

    def project_qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v per head: [B, M, N, d] each.

        Without autograd, plain Linear projections run as three GEMMs, so that v is dense (the depthwise conv
        reads its patch rows without a copy when B = 1 or there is no prefix) and each output stays a third of
        the fused one (under glibc's 32 MiB mmap threshold up to 16k tokens at C = 384: reused heap memory
        instead of fresh pages faulted in on every call). Otherwise, and for any other projection module or
        one with hooks, the module runs as it is.
        """
        trains = torch.is_grad_enabled() and any(p.requires_grad for p in self.qkv.parameters())
        parts = None if trains else self._qkv_parts()  # slices would cost two more gradient copies
        if parts is None:
            return self._qkv_heads(x)
        q, k, v = (self._heads(F.linear(x, weight, bias)) for weight, bias in parts)
        return q, k, v

    def _qkv_parts(self) -> list[tuple[torch.Tensor, torch.Tensor | None]] | None:
        """(weight, bias) of q, k and v (`qkv_projections`) when the projection runs plain Linear layers without
        hooks (the carried `qkv` Linear, or the q_proj/k_proj/v_proj or bias-free qkv a view reads), else None.
        Cached: the parts are views, so in-place updates show through."""
        qkv = self.qkv
        linears = qkv_linears(qkv)
        plain = linears is not None and all(
            type(m) is nn.Linear and not (m._forward_hooks or m._forward_pre_hooks) for m in linears
        )
        if not plain:
            return None
        if torch.compiler.is_compiling():  # traced once: no cache (and no data_ptr) needed
            return qkv_projections(qkv)
        key = tuple(p.data_ptr() for p in qkv.parameters())
        if self._qkv_split is None or self._qkv_split[0] != key:
            self._qkv_split = (key, qkv_projections(qkv))
        return self._qkv_split[1]

    def pooled_queries(self, x: torch.Tensor, q: torch.Tensor, layout: TokenLayout) -> torch.Tensor:
        """t̃ = avgpool_{h×w}(q[patches]) at full width: [B, n, C].

        Pooling commutes with the affine q projection (window weights sum to 1), so on grids much larger
        than the contrast grid the layer input is pooled (two GEMMs over a dense grid) and only the n pooled
        rows are projected; with a per-token q norm, or on small grids, the projected queries are pooled.
        """
        B = x.shape[0]
        large_grid = layout.num_patches >= _POOL_INPUT_MIN_RATIO * self.num_contrast_tokens
        projection = query_projection(self.qkv) if large_grid and isinstance(self.q_norm, nn.Identity) else None
        if projection is not None:
            patches = x[:, layout.num_prefix_tokens :]  # [B, H·W, C_in]
            return F.linear(adaptive_avg_pool_tokens(patches, layout.grid, self.contrast_grid), *projection)
        if torch.compiler.is_compiling():  # exporters bake adaptive_avg_pool2d's windows for the traced grid
            patches = q.transpose(1, 2).reshape(B, -1, self.attn_dim)[:, layout.num_prefix_tokens :]
            return adaptive_avg_pool_tokens(patches, layout.grid, self.contrast_grid)
        pooled = F.adaptive_avg_pool2d(_patch_grid(q, layout), self.contrast_grid)  # [B, C, h, w], channels-last
        return pooled.permute(0, 2, 3, 1).reshape(B, self.num_contrast_tokens, self.attn_dim)

    def contrast_tokens(self, x: torch.Tensor, q: torch.Tensor, layout: TokenLayout) -> torch.Tensor:
        """t± = t̃ + e±, per head: [B, M, 2n, d], the n t₊ tokens then the n t₋."""
        B, n = x.shape[0], self.num_contrast_tokens
        pooled = self.pooled_queries(x, q, layout).unsqueeze(1)  # [B, 1, n, C]
        embed = torch.cat([self.contrast_embed_pos, self.contrast_embed_neg])  # [2, n, C]
        tokens = pooled + embed.to(pooled.dtype)  # one add for both streams: [B, 2, n, C]
        # reshape, not view: exporters' decompositions may give the add a pooled operand's (channels-last) strides
        return tokens.reshape(B, 2 * n, self.num_heads, self.head_dim).transpose(1, 2)

    def forward_tokens(self, x: torch.Tensor, layout: TokenLayout) -> torch.Tensor:
        """x: [B, N, dim] with N = prefix + H·W tokens -> [B, N, dim_out]: the fused CPU kernel for float32
        inference, else the composite path (recomputed in backward when training, see `recompute_in_backward`)."""
        # Under torch.compile the kernel is one opaque op whose grid sizes stay symbolic; an exported graph must
        # hold standard operators only, so export takes the composite path.
        if not torch.compiler.is_exporting() and self._fused_kernel_usable(x):
            if torch.is_autocast_enabled("cpu"):  # the kernel is float32: it runs so, like an autocast fp32 op
                with torch.autocast("cpu", enabled=False):
                    y = self.attend_fused(x.float(), layout)
                # returned in autocast's dtype, as the composite path (ending in the projection) and a compiled
                # model return it: eager and compiled give the same dtype downstream
                return y.to(torch.get_autocast_dtype("cpu"))
            return self.attend_fused(x, layout)
        q, k, v = self.project_qkv(x)  # [B, M, N, d] each
        trains = q.requires_grad or v.requires_grad or self.contrast_embed_pos.requires_grad  # frozen backbone too
        if self.recompute_in_backward and torch.is_grad_enabled() and trains:
            # Training: keep only x, q, k, v (what softmax attention keeps, less its output) and run the rest
            # again in backward; the 2n-token tensors would otherwise add up to 8n/N token rows per layer.
            return checkpoint(self.attend, x, q, k, v, layout, use_reentrant=False)
        return self.attend(x, q, k, v, layout)

    def _fused_kernel_usable(self, x: torch.Tensor) -> bool:
        """float32 CPU inference (nothing needs a gradient; float32 weights, input float32 or under CPU autocast)
        and the kernel built (see `fused_cpu`)."""
        if x.device.type != "cpu" or self.contrast_embed_pos.dtype != torch.float32:
            return False
        if x.dtype != torch.float32 and not (torch.is_autocast_enabled("cpu") and x.dtype.is_floating_point):
            return False
        if torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in self.parameters())):
            return False
        return fused_cpu.kernel_available()

    def attend_fused(self, x: torch.Tensor, layout: TokenLayout) -> torch.Tensor:
        """`forward` through the fused CPU kernel (float32 inference): the same function, one op for everything
        between the projections, the local term included. With plain q/k norms the q and v biases are folded into
        the kernel (the k bias cancels in every softmax), which spares the GEMMs' bias copies."""
        parts = self._qkv_parts()
        P, (H, W) = layout.num_prefix_tokens, layout.grid
        if parts is not None and isinstance(self.q_norm, nn.Identity) and isinstance(self.k_norm, nn.Identity):
            (w_q, q_bias), (w_k, _), (w_v, v_bias) = parts
            q, k, v = (F.linear(x, weight) for weight in (w_q, w_k, w_v))  # [B, N, C] each
            args = (self._heads(k), self._heads(v), P, H, W, q_bias, v_bias, *self.kernel_arguments())
            if torch.compiler.is_compiling():  # a functional op: the compiler plans the buffers itself
                o, into = fused_cpu.attend_cpu(self._heads(q), *args), None
            else:  # eager: o over q's buffer, the output in k's (both dead after the op)
                o, into = fused_cpu.attend_cpu_into_q(q, self._heads(q), *args), k
            return self.project_out(x, self.apply_token_gain(x, o, layout), into=into)
        q, k, v = self.project_qkv(x)
        q, k = self.q_norm(q), self.k_norm(k)
        o = fused_cpu.attend_cpu(q, k, v, P, H, W, None, None, *self.kernel_arguments())
        return self.project_out(x, self.apply_token_gain(x, o, layout))

    def kernel_arguments(self) -> tuple:
        """The fused kernel's arguments after the biases (see the C++ source), rebuilt only when a parameter
        changes (in place or replaced): inference pays no op for λ, the scaled norm weights or the conv taps."""
        if torch.compiler.is_compiling():  # traced: built in the graph, no Python-side cache (nor data_ptr)
            return self._build_kernel_arguments()
        sources = (
            self.contrast_embed_pos, self.contrast_embed_neg, self.stage2_temperature, self.stage1_norm.weight,
            self.stage2_norm.weight, self.dwc.weight, self.dwc.bias, *self.lambda1.vectors(), *self.lambda2.vectors(),
            self.global_scale, self.local_scale,
        )  # fmt: skip
        key = tuple((p.data_ptr(), p._version) for p in sources if p is not None)
        if self._kernel_arguments is None or self._kernel_arguments[0] != key:
            self._kernel_arguments = (key, self._build_kernel_arguments())
        return self._kernel_arguments[1]

    def _build_kernel_arguments(self) -> tuple:
        with torch.no_grad():
            scale = 1 - self.lambda_init
            temperature = self.stage2_temperature
            return (
                self.contrast_embed_pos[0].float().contiguous(),  # [n, C]
                self.contrast_embed_neg[0].float().contiguous(),
                None if temperature is None else temperature.float().contiguous(),  # [M]
                self.lambda1().float(),  # 0-d: read by the kernel, no sync here
                self.lambda2().float(),
                (self.stage1_norm.weight.float() * scale).contiguous(),  # [d]
                self._stage2_weight(scale),
                self.stage1_norm.eps,
                self.stage2_norm.eps,
                self.scale,
                self.prefix_readout == "exact",
                self.softmax == "joint",
                *self.contrast_grid,
                self.dwc.weight.float().reshape(self.attn_dim, 9).t().contiguous(),  # [9, C], tap-major
                self.dwc.bias.float().contiguous(),
                self.local_window,  # the local term, β ⊙ (neighbourhood attention + v's bias), in the same op
                None if self.local_scale is None else self.local_scale.float().contiguous(),  # β [C]
            )

    def _stage2_weight(self, scale: float) -> torch.Tensor:
        """RMSNorm₂'s weight for the kernel, times `scale`: [d], or [C] (per head) times α with a local term."""
        weight = self.stage2_norm.weight.float() * scale
        if self.global_scale is None:
            return weight.contiguous()
        return (weight.repeat(self.num_heads) * self.global_scale.float()).contiguous()

    def attend(
        self,
        x: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layout: TokenLayout,
        local_values: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Everything after the q/k/v projection: x [B, N, dim] and q, k, v [B, M, N, d] -> [B, N, dim_out].

        k and v may hold fewer tokens than q (keys of a spatial reduction); the local term then reads
        `local_values` ([B, M, N, d] on the query grid) instead of v.
        """
        n, P = self.num_contrast_tokens, layout.num_prefix_tokens
        exact = P if self.prefix_readout == "exact" else 0  # prefix rows read all N keys in Stage I
        q, k = self.q_norm(q), self.k_norm(k)
        contrast = self.contrast_tokens(x, q, layout)  # [B, M, 2n, d]
        lambda1 = self.lambda1().to(q.dtype)
        lambda2 = self.lambda2().to(q.dtype)

        # Stage I: one SDPA call over all N tokens (prefix included) for the 2n contrast tokens and, under
        # exact read-out, the P prefix queries, whose plain-softmax output is final.
        queries = torch.cat([contrast, q[:, :, :exact]], dim=2) if exact else contrast  # [B, M, 2n+P', d]
        u_pos, u_neg, prefix_out = scaled_dot_product_attention(queries, k, v, scale=self.scale).split(
            [n, n, exact], dim=2
        )
        # Each 2n-token tensor dies once used: below ~4 patches per contrast token they set the layer's peak.
        del queries
        if exact:  # P rows; the view would keep all 2n+P Stage-I rows alive until the end
            prefix_out = prefix_out.clone()
        v_hat = torch.addcmul(u_pos, u_neg, lambda1, value=-1)  # u₊ − λ₁u₋
        v_hat = _rms_norm(v_hat, self.stage1_norm, 1 - self.lambda_init, inplace=True)  # [B, M, n, d]
        del u_pos, u_neg  # [B, M, n, d] each

        # Stage II: every token reads the 2n contrast tokens.
        keys = contrast
        del contrast  # `keys` is the only reference left: scaling it below frees the unscaled tokens
        if self.stage2_temperature is not None:  # s·τ·q·tᵀ: scale the 2n keys rather than the N queries
            keys = keys * self.stage2_temperature.to(keys.dtype).view(1, -1, 1, 1)
        if self.softmax == "joint":
            # softmax over [t₊; t₋] with values [v̂; −λ₂v̂] equals (A₊ − λ₂A₋)·v̂.
            o = scaled_dot_product_attention(q, keys, torch.cat([v_hat, -lambda2 * v_hat], dim=2), scale=self.scale)
        else:
            k_pos, k_neg = keys.split(n, dim=2)
            o = scaled_dot_product_attention(q, k_pos, v_hat, scale=self.scale)
            o = o - lambda2 * scaled_dot_product_attention(q, k_neg, v_hat, scale=self.scale)
        local = None
        if self.local_window:  # [B, M, H·W, d]
            if local_values is not None:
                raise ValueError("the local term reads keys on the query grid; a spatial reduction's keys are not")
            local = neighbourhood_attention(q, k, v, layout, self.local_window, self.scale)
        return self.output(x, o, prefix_out, v if local_values is None else local_values, layout, local)

    def output(
        self,
        x: torch.Tensor,
        o: torch.Tensor,
        prefix_out: torch.Tensor,
        v: torch.Tensor,
        layout: TokenLayout,
        local: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """y = proj((1−λ_init)·RMSNorm₂(o) + DWC(v[patches])), prefix rows replaced by `prefix_out` when given.

        o: Stage-II output [B, M, N, d]; prefix_out: exact prefix read-out [B, M, P', d] (P' = 0: none);
        v: values [B, M, N, d]; local: the neighbourhood term of the patch rows [B, M, H·W, d], mixed in as
        α⊙o + β⊙local (None: no local term). Without autograd, o is normalised in place.
        """
        B, _, N, _ = o.shape
        P = layout.num_prefix_tokens
        # SDPA returns [B, M, N, d] with [B, N, M, d] memory: normalise in that layout, so merging heads is a view.
        o = _rms_norm(o.transpose(1, 2), self.stage2_norm, 1 - self.lambda_init, inplace=True)  # [B, N, M, d]
        if prefix_out.shape[2]:
            o[:, :P] = prefix_out.transpose(1, 2)
        o = o.reshape(B, N, self.attn_dim)
        if local is not None:
            o = self._mix_local(o, local, P)

        # Local term: depthwise 3×3 conv on the patch values, added in place to the patch rows (prefix rows get
        # none). Both grids are channels-last views of token rows (oneDNN's NHWC depthwise kernel, ~2x NCHW on CPU).
        H, W = layout.grid
        add_conv_(o[:, P:].view(B, H, W, self.attn_dim).permute(0, 3, 1, 2), _patch_grid(v, layout), self.dwc)

        return self.project_out(x, self.apply_token_gain(x, o, layout))

    def _mix_local(self, o: torch.Tensor, local: torch.Tensor, P: int) -> torch.Tensor:
        """o [B, N, C] with its Stage-II rows (patches; every row under contrast read-out) times α and its patch rows
        plus β⊙local (local [B, M, H·W, d]); in place without autograd."""
        B, N, C = o.shape
        start = P if self.prefix_readout == "exact" else 0
        local = local.transpose(1, 2).reshape(B, N - P, C)
        alpha, beta = self.global_scale.to(o.dtype), self.local_scale.to(o.dtype)
        if torch.is_grad_enabled() and (o.requires_grad or local.requires_grad or alpha.requires_grad):
            rows = [o[:, :start], o[:, start:P] * alpha, torch.addcmul(o[:, P:] * alpha, local, beta)]
            return torch.cat(rows, dim=1)
        o[:, start:].mul_(alpha)
        o[:, P:].addcmul_(local, beta)
        return o

    def apply_token_gain(self, x: torch.Tensor, o: torch.Tensor, layout: TokenLayout) -> torch.Tensor:
        """o [B, N, attn_dim] with its Stage-II rows (patches; every row under contrast read-out) scaled per head
        by exp(token_gain(x)); o itself when the layer has no gain. In place without autograd."""
        if self.token_gain is None:
            return o
        B, N, _ = o.shape
        start = layout.num_prefix_tokens if self.prefix_readout == "exact" else 0
        log_gain = self.token_gain(x[:, start:])  # [B, N', M]
        gain = log_gain.to(torch.promote_types(log_gain.dtype, torch.float32)).exp().to(o.dtype).unsqueeze(-1)
        rows = o[:, start:].view(B, N - start, self.num_heads, self.head_dim)
        if torch.is_grad_enabled() and (o.requires_grad or gain.requires_grad):
            return torch.cat([o[:, :start], (rows * gain).view(B, N - start, -1)], dim=1)
        rows.mul_(gain)
        return o

    def project_out(self, x: torch.Tensor, o: torch.Tensor, into: torch.Tensor | None = None) -> torch.Tensor:
        """The carried output path: o [B, N, attn_dim] -> proj(gate(norm(o))) [B, N, dim_out]. `into`: a dense
        buffer of the caller's, dead after this call, that receives the projection when it fits (see `_project`)."""
        return self.proj_drop(self._project(self.norm_and_gate(x, o), into))

    def _project(self, o: torch.Tensor, into: torch.Tensor | None) -> torch.Tensor:
        """proj(o), written into `into` (no fresh tensor) when proj is a plain Linear without hooks whose output
        has into's size and dtype; else proj(o) as it is."""
        proj = self.proj
        rows = o.numel() // o.shape[-1]
        plain = type(proj) is nn.Linear and not (proj._forward_hooks or proj._forward_pre_hooks)
        if into is None or not plain or into.numel() != rows * proj.out_features or into.dtype != o.dtype:
            return proj(o)
        out = into.view(rows, proj.out_features)
        o_rows = o.reshape(rows, o.shape[-1])
        if proj.bias is None:
            torch.mm(o_rows, proj.weight.t(), out=out)
        else:
            torch.addmm(proj.bias, o_rows, proj.weight.t(), out=out)
        return out.view(*o.shape[:-1], proj.out_features)

    @torch.no_grad()
    def lambdas(self) -> tuple[float, float]:
        """Current (λ₁, λ₂), for health traces (keep them in [0, 1))."""
        return float(self.lambda1()), float(self.lambda2())

    def extra_repr(self) -> str:
        return (
            f"heads={self.num_heads}, head_dim={self.head_dim}, contrast_grid={self.contrast_grid}, "
            f"layer_index={self.layer_index}, lambda_init={self.lambda_init:.4f}, softmax={self.softmax!r}"
            + (f", prefix_readout={self.prefix_readout!r}" if self.prefix_readout != "contrast" else "")
            + (", stage2_temperature=True" if self.stage2_temperature is not None else "")
            + (", token_magnitude=True" if self.token_gain is not None else "")
        )
