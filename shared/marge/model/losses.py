"""The reconstruction loss's kernels: token NLL in fp32, over vocabulary chunks, and the fused output projection +
NLL that never holds a [rows x vocabulary] logits tensor (`trainer.loss_chunk_tokens`).

Tensor-shape suffixes follow the legend in `marge.model.network`."""


from __future__ import annotations

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import Tensor


def token_nll(logits_RV: Tensor, labels_R: Tensor, pad_id: int) -> Tensor:
    """Negative log-likelihood of each row's label (0 where the label is padding), in fp32."""
    return F.cross_entropy(logits_RV.float(), labels_R, ignore_index=pad_id, reduction="none")


def projected_token_nll(states_RD: Tensor, weight_VD: Tensor, labels_R: Tensor, pad_id: int) -> Tensor:
    """`token_nll` of the tied output projection `states @ weight.T` (what `Marge.logits` computes)."""
    return token_nll(states_RD @ weight_VD.T, labels_R, pad_id)


def chunked_token_nll(states_RD: Tensor, weight_VD: Tensor, labels_R: Tensor, pad_id: int, chunk: int) -> Tensor:
    """`token_nll` of the tied output projection `states @ weight.T`, `chunk` rows at a time. With gradients on,
    each chunk is checkpointed (its logits are recomputed in the backward pass, under the same autocast), so
    at most one chunk's logits exist at any time; the result and its gradients equal the unchunked loss's."""
    pieces = []
    for start in range(0, states_RD.shape[0], chunk):
        rows = slice(start, start + chunk)
        if torch.is_grad_enabled():
            pieces.append(torch.utils.checkpoint.checkpoint(projected_token_nll, states_RD[rows], weight_VD,
                                                            labels_R[rows], pad_id, use_reentrant=False))
        else:
            pieces.append(projected_token_nll(states_RD[rows], weight_VD, labels_R[rows], pad_id))
    return torch.cat(pieces)


class FusedLinearNLL(torch.autograd.Function):
    """sum over rows of -log softmax(states @ weight.T)[label] (padding labels excluded), computed `chunk` rows at a
    time with its gradients made in the same pass (a fused linear cross-entropy, the algorithm of Liger-kernel's, in
    plain PyTorch): per chunk one matmul for the logits and two for the gradients of states and weight, and no
    chunk's logits kept. Its output is the sum (what the training loss backpropagates, scaled by any weight) and each
    row's NLL, which carries no gradient."""

    @staticmethod
    def forward(ctx, states_RD: Tensor, weight_VD: Tensor, labels_R: Tensor, pad_id: int, chunk: int):
        rows_total = states_RD.shape[0]
        grad_states_RD = torch.zeros_like(states_RD)
        grad_weight_VD = torch.zeros(weight_VD.shape, dtype=torch.promote_types(weight_VD.dtype, torch.float32),
                                     device=weight_VD.device)
        nll_R = torch.zeros(rows_total, dtype=torch.float32, device=states_RD.device)
        for start in range(0, rows_total, chunk):
            rows = slice(start, min(rows_total, start + chunk))
            s_CD, y_C = states_RD[rows], labels_R[rows]
            logits_CV = (s_CD @ weight_VD.T).float()  # under the caller's autocast, as the unfused loss
            valid_C = y_C != pad_id
            nll_R[rows] = torch.where(valid_C, torch.logsumexp(logits_CV, -1) - logits_CV.gather(1, y_C[:, None])[:, 0],
                                      torch.zeros((), device=logits_CV.device))
            dlogits_CV = torch.softmax(logits_CV, -1)  # d nll / d logits = softmax - one-hot, on valid rows
            dlogits_CV[torch.arange(len(y_C), device=y_C.device), y_C] -= 1.0
            dlogits_CV = (dlogits_CV * valid_C[:, None]).to(s_CD.dtype)  # autocast, where on, casts the products
            grad_states_RD[rows] = (dlogits_CV @ weight_VD.to(s_CD.dtype)).to(grad_states_RD.dtype)
            grad_weight_VD += (dlogits_CV.T @ s_CD).to(grad_weight_VD.dtype)
        ctx.save_for_backward(grad_states_RD, grad_weight_VD)
        ctx.weight_dtype = weight_VD.dtype
        ctx.mark_non_differentiable(nll_R)
        return nll_R.sum(), nll_R

    @staticmethod
    def backward(ctx, grad_sum: Tensor, grad_rows: Tensor):
        grad_states_RD, grad_weight_VD = ctx.saved_tensors
        return (grad_states_RD * grad_sum.to(grad_states_RD.dtype), (grad_weight_VD * grad_sum).to(ctx.weight_dtype),
                None, None, None)


def fused_linear_nll(states_RD: Tensor, weight_VD: Tensor, labels_R: Tensor, pad_id: int,
                     chunk: int) -> tuple[Tensor, Tensor]:
    """(summed NLL with its gradient, each row's NLL) of the tied output projection: `FusedLinearNLL`."""
    return FusedLinearNLL.apply(states_RD, weight_VD, labels_R, pad_id, chunk)


