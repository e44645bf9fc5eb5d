"""Standard ranking models, written without IKBO in mind, for trying `to_ikbo` on: each follows its
paper and the idiom of its public implementations (DeepCTR-Torch, torchrec, FuxiCTR, generative-recommenders),
with the BatchNorm / LayerNorm / Dropout those have, and replicates the user's features to candidate
rows itself, each in another common spelling.

Every model takes user tensors at U rows, candidate tensors at B rows and `cand_to_user` [B] last;
`MODELS[name]` gives the model class, `build(name, seed, dims=...)` makes it and `inputs(model, U, B, gen)`
draws a request for it. Its sizes are a `Dims` (`DIMS["small"]`, the default, or `DIMS["large"]`, near
production for the attention-bearing models), each unlike the U and B of the tests and of the 15:1024
benchmark (row counts tell user tensors from candidate tensors).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

HEAD_SIZES = (16, 32, 64, 128)  # the head sizes the Triton attention kernels take


@dataclass(frozen=True)
class Dims:
    """The sizes the zoo's models and their inputs read."""

    emb: int = 32  # embedding dim
    history: int = 50  # short history
    long_history: int = 256  # long history (SIM)
    topk: int = 20  # items the SIM search keeps
    heads: int = 2
    hidden: tuple[int, ...] = (256, 128)  # the MLP widths most models share
    tasks: int = 2
    user_fields: int = 4  # user sparse fields
    user_vocab: int = 1000
    user_dense: int = 8  # user dense features
    cand_fields: int = 2  # candidate sparse fields
    cand_vocab: int = 1000
    cand_dense: int = 6  # candidate dense features
    item_vocab: int = 2000
    cat_vocab: int = 100  # item categories

    def __post_init__(self):
        if self.emb % self.heads or self.emb // self.heads not in HEAD_SIZES:
            raise ValueError(f"Dims: emb / heads must be one of {HEAD_SIZES}, got {self.emb} / {self.heads}")
        if not 0 < self.topk <= self.long_history:
            raise ValueError(f"Dims: topk must be in [1, long_history = {self.long_history}], got {self.topk}")


DIMS = {
    "small": Dims(),
    # history 512: at B = 1024, bf16, a B·heads·L² score tensor (HSTU, BST) is 1.1 GB; HSTU's forward peaks ~3.3 GB
    "large": Dims(
        emb=128, history=512, long_history=2048, topk=128, hidden=(512, 256),
        user_vocab=100_000, cand_vocab=100_000, item_vocab=100_000, cat_vocab=1000,
    ),
}  # fmt: skip


def mlp(widths, norm="bn", act=nn.ReLU, dropout=0.1):
    """Linear → BatchNorm1d | LayerNorm → activation → Dropout, per hidden layer (DeepCTR-Torch DNN)."""
    layers = []
    for fan_in, fan_out in zip(widths[:-1], widths[1:]):
        layers.append(nn.Linear(fan_in, fan_out))
        if norm == "bn":
            layers.append(nn.BatchNorm1d(fan_out))
        elif norm == "ln":
            layers.append(nn.LayerNorm(fan_out))
        layers += [act(), nn.Dropout(dropout)]
    return nn.Sequential(*layers)


# ----------------------------------------------------------------------------- DIN


class Dice(nn.Module):
    """Data-adaptive activation of DIN (DeepCTR-Torch `activation.Dice`): BatchNorm inside."""

    def __init__(self, emb_size, dim=2, epsilon=1e-8):
        super().__init__()
        assert dim == 2 or dim == 3
        self.bn = nn.BatchNorm1d(emb_size, eps=epsilon)
        self.sigmoid = nn.Sigmoid()
        self.dim = dim
        self.alpha = nn.Parameter(torch.zeros((emb_size,) if dim == 2 else (emb_size, 1)))

    def forward(self, x):
        assert x.dim() == self.dim
        if self.dim == 2:
            x_p = self.sigmoid(self.bn(x))
            return self.alpha * (1 - x_p) * x + x_p * x
        x = torch.transpose(x, 1, 2)
        x_p = self.sigmoid(self.bn(x))
        out = self.alpha * (1 - x_p) * x + x_p * x
        return torch.transpose(out, 1, 2)


class LocalActivationUnit(nn.Module):
    """DIN's attention unit: an MLP over [q, k, q − k, q·k] (DeepCTR-Torch `layers.core`)."""

    def __init__(self, embedding_dim, hidden_units=(64, 16)):
        super().__init__()
        widths = (4 * embedding_dim, *hidden_units)
        self.linears = nn.ModuleList(nn.Linear(a, b) for a, b in zip(widths[:-1], widths[1:]))
        self.activations = nn.ModuleList(Dice(h, dim=3) for h in hidden_units)
        self.dense = nn.Linear(hidden_units[-1], 1)

    def forward(self, query, user_behavior):
        user_behavior_len = user_behavior.size(1)
        queries = query.expand(-1, user_behavior_len, -1)
        attention_input = torch.cat([queries, user_behavior, queries - user_behavior, queries * user_behavior], dim=-1)
        x = attention_input
        for linear, activation in zip(self.linears, self.activations):
            x = activation(linear(x))
        return self.dense(x)


class AttentionSequencePoolingLayer(nn.Module):
    def __init__(self, embedding_dim):
        super().__init__()
        self.local_att = LocalActivationUnit(embedding_dim)

    def forward(self, query, keys, keys_length):
        batch_size, max_length, _ = keys.size()
        keys_masks = torch.arange(max_length, device=keys_length.device, dtype=keys_length.dtype).repeat(batch_size, 1)
        keys_masks = keys_masks < keys_length.view(-1, 1)
        keys_masks = keys_masks.unsqueeze(1)  # [B, 1, T]
        attention_score = self.local_att(query, keys)  # [B, T, 1]
        outputs = torch.transpose(attention_score, 1, 2)  # [B, 1, T]
        paddings = torch.zeros_like(outputs)
        outputs = torch.where(keys_masks, outputs, paddings)
        return torch.matmul(outputs, keys)  # [B, 1, E]


class DIN(nn.Module):
    """Deep Interest Network (Zhou et al. 2018): target-conditioned pooling of the history, then a DNN
    with BatchNorm and Dice. Replicates the user's raw features with `x[cand_to_user]`."""

    def __init__(self, dims: Dims = Dims()):
        super().__init__()
        self.dims = dims
        E = dims.emb
        self.user_emb = nn.Embedding(dims.user_vocab, E)
        self.item_emb, self.cat_emb = nn.Embedding(dims.item_vocab, E // 2), nn.Embedding(dims.cat_vocab, E // 2)
        self.attention = AttentionSequencePoolingLayer(E)
        self.dnn = mlp((dims.user_fields * E + 2 * E, 200, 80), norm="bn", act=lambda: nn.PReLU())
        self.out = nn.Linear(80, 1)

    def forward(self, user_ids, hist_items, hist_cats, hist_len, cand_items, cand_cats, cand_to_user):
        user_ids, hist_items = user_ids[cand_to_user], hist_items[cand_to_user]
        hist_cats, hist_len = hist_cats[cand_to_user], hist_len[cand_to_user]
        keys = torch.cat([self.item_emb(hist_items), self.cat_emb(hist_cats)], dim=-1)  # [B, L, E]
        query = torch.cat([self.item_emb(cand_items), self.cat_emb(cand_cats)], dim=-1).unsqueeze(1)  # [B, 1, E]
        hist = self.attention(query, keys, hist_len)
        x = torch.cat([self.user_emb(user_ids).flatten(1), query.squeeze(1), hist.squeeze(1)], dim=-1)
        return torch.sigmoid(self.out(self.dnn(x)))


# ----------------------------------------------------------------------------- DIEN


class AUGRUCell(nn.Module):
    """GRU with attentional update gate (DIEN; DeepCTR-Torch `AUGRUCell`)."""

    def __init__(self, input_size, hidden_size):
        super().__init__()
        self.weight_ih = nn.Parameter(torch.randn(3 * hidden_size, input_size) / math.sqrt(input_size))
        self.weight_hh = nn.Parameter(torch.randn(3 * hidden_size, hidden_size) / math.sqrt(hidden_size))
        self.bias_ih = nn.Parameter(torch.zeros(3 * hidden_size))
        self.bias_hh = nn.Parameter(torch.zeros(3 * hidden_size))

    def forward(self, inputs, hx, att_score):
        gi = F.linear(inputs, self.weight_ih, self.bias_ih)
        gh = F.linear(hx, self.weight_hh, self.bias_hh)
        i_r, i_z, i_n = gi.chunk(3, 1)
        h_r, h_z, h_n = gh.chunk(3, 1)
        reset_gate = torch.sigmoid(i_r + h_r)
        update_gate = torch.sigmoid(i_z + h_z)
        new_state = torch.tanh(i_n + reset_gate * h_n)
        update_gate = att_score.view(-1, 1) * update_gate
        return (1.0 - update_gate) * hx + update_gate * new_state


class DIEN(nn.Module):
    """Deep Interest Evolution Network (Zhou et al. 2019): a GRU extracts interests from the history,
    target attention scores them, an AUGRU evolves them. Replicates with `index_select`."""

    def __init__(self, hidden: int | None = None, dims: Dims = Dims()):
        super().__init__()
        self.dims = dims
        E = dims.emb
        hidden = E if hidden is None else hidden
        self.item_emb = nn.Embedding(dims.item_vocab, E)
        self.user_emb = nn.Embedding(dims.user_vocab, E)
        self.interest_extractor = nn.GRU(E, hidden, batch_first=True)
        self.att = nn.Linear(E, hidden, bias=False)
        self.evolution = AUGRUCell(hidden, hidden)
        self.dnn = mlp((dims.user_fields * E + E + hidden, 200, 80), norm="bn")
        self.out = nn.Linear(80, 1)

    def forward(self, user_ids, hist_items, hist_len, cand_items, cand_to_user):
        rows = cand_to_user.long()
        user_ids, hist_items, hist_len = (t.index_select(0, rows) for t in (user_ids, hist_items, hist_len))
        target = self.item_emb(cand_items)  # [B, E]
        interests, _ = self.interest_extractor(self.item_emb(hist_items))  # [B, L, H]
        mask = torch.arange(interests.size(1), device=hist_len.device)[None, :] < hist_len[:, None]
        scores = torch.bmm(interests, self.att(target).unsqueeze(-1)).squeeze(-1)  # [B, L]
        scores = F.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
        hx = interests.new_zeros(interests.size(0), interests.size(2))
        for t in range(interests.size(1)):
            h = self.evolution(interests[:, t], hx, scores[:, t])
            hx = torch.where(mask[:, t : t + 1], h, hx)
        x = torch.cat([self.user_emb(user_ids).flatten(1), target, hx], dim=-1)
        return torch.sigmoid(self.out(self.dnn(x)))


# ----------------------------------------------------------------------------- BST


class BST(nn.Module):
    """Behavior Sequence Transformer (Chen et al. 2019): a transformer layer over the history with the
    target item appended, position embeddings, key padding mask; the outputs flattened into an MLP with
    LeakyReLU. Replicates with `x[cand_to_user]`."""

    def __init__(self, dims: Dims = Dims()):
        super().__init__()
        self.dims = dims
        E, L = dims.emb, dims.history
        self.item_emb = nn.Embedding(dims.item_vocab, E)
        self.pos_emb = nn.Parameter(torch.randn(L + 1, E) * 0.1)
        layer = nn.TransformerEncoderLayer(E, dims.heads, dim_feedforward=4 * E, dropout=0.1, batch_first=True)
        self.transformer = nn.TransformerEncoder(layer, num_layers=1, enable_nested_tensor=False)
        self.user_emb = nn.Embedding(dims.user_vocab, E)
        self.dnn = mlp(((L + 1) * E + dims.user_fields * E, 256, 64), norm=None, act=nn.LeakyReLU, dropout=0.2)
        self.out = nn.Linear(64, 1)

    def forward(self, user_ids, hist_items, hist_len, cand_items, cand_to_user):
        seq = torch.cat([self.item_emb(hist_items[cand_to_user]), self.item_emb(cand_items)[:, None]], dim=1)
        seq = seq + self.pos_emb
        positions = torch.arange(seq.shape[1], device=seq.device)
        padding = positions[None, :] >= hist_len[cand_to_user][:, None]
        padding[:, -1] = False  # the target is never padding
        out = self.transformer(seq, src_key_padding_mask=padding)
        x = torch.cat([out.flatten(1), self.user_emb(user_ids[cand_to_user]).flatten(1)], dim=-1)
        return torch.sigmoid(self.out(self.dnn(x)))


# ----------------------------------------------------------------------------- DCN-v2


class CrossNetV2(nn.Module):
    """x_{l+1} = x_0 ⊙ (W_l x_l + b_l) + x_l (Wang et al. 2021; torchrec `CrossNet`, FuxiCTR `CrossNetV2`)."""

    def __init__(self, input_dim, num_layers=3):
        super().__init__()
        self.cross_layers = nn.ModuleList(nn.Linear(input_dim, input_dim) for _ in range(num_layers))

    def forward(self, x0):
        x = x0
        for layer in self.cross_layers:
            x = x0 * layer(x) + x
        return x


class DCNv2(nn.Module):
    """DCN-v2, parallel: a cross network and a deep network over the same features (BatchNorm on the
    dense features, as in FuxiCTR). Replicates with `torch.gather` over an index expanded from the mapping."""

    def __init__(self, dims: Dims = Dims()):
        super().__init__()
        self.dims = dims
        E = dims.emb
        self.user_norm, self.cand_norm = nn.BatchNorm1d(dims.user_dense), nn.BatchNorm1d(dims.cand_dense)
        self.user_emb, self.cand_emb = nn.Embedding(dims.user_vocab, E), nn.Embedding(dims.cand_vocab, E)
        dim = dims.user_dense + dims.user_fields * E + dims.cand_dense + dims.cand_fields * E
        self.cross = CrossNetV2(dim)
        self.deep = mlp((dim, *dims.hidden), norm="bn")
        self.out = nn.Linear(dim + dims.hidden[-1], 1)

    def forward(self, user_dense, user_ids, cand_dense, cand_ids, cand_to_user):
        user = torch.cat([self.user_norm(user_dense), self.user_emb(user_ids).flatten(1)], dim=1)
        index = cand_to_user.long().unsqueeze(1).expand(-1, user.size(1))
        user = torch.gather(user, 0, index)
        cand = torch.cat([self.cand_norm(cand_dense), self.cand_emb(cand_ids).flatten(1)], dim=1)
        x0 = torch.cat([user, cand], dim=1)
        return torch.sigmoid(self.out(torch.cat([self.cross(x0), self.deep(x0)], dim=1)))


# ----------------------------------------------------------------------------- DeepFM


class FM(nn.Module):
    """Second-order factorization machine over field embeddings [B, F, E] (DeepCTR-Torch `FM`)."""

    def forward(self, inputs):
        square_of_sum = torch.pow(torch.sum(inputs, dim=1, keepdim=True), 2)
        sum_of_square = torch.sum(inputs * inputs, dim=1, keepdim=True)
        cross_term = square_of_sum - sum_of_square
        return 0.5 * torch.sum(cross_term, dim=2, keepdim=False)


class DeepFM(nn.Module):
    """DeepFM (Guo et al. 2017): a linear part, an FM over all field embeddings and a DNN with
    BatchNorm and Dropout over the same embeddings. Replicates with `Tensor.index_select`."""

    def __init__(self, dims: Dims = Dims()):
        super().__init__()
        self.dims = dims
        E, dense = dims.emb, dims.user_dense + dims.cand_dense
        self.user_emb, self.cand_emb = nn.Embedding(dims.user_vocab, E), nn.Embedding(dims.cand_vocab, E)
        self.user_linear, self.cand_linear = nn.Embedding(dims.user_vocab, 1), nn.Embedding(dims.cand_vocab, 1)
        self.dense_linear = nn.Linear(dense, 1, bias=False)
        self.fm = FM()
        self.dnn = mlp(((dims.user_fields + dims.cand_fields) * E + dense, *dims.hidden), norm="bn", dropout=0.2)
        self.dnn_linear = nn.Linear(dims.hidden[-1], 1, bias=False)

    def forward(self, user_ids, user_dense, cand_ids, cand_dense, cand_to_user):
        rows = cand_to_user.long()
        user_ids, user_dense = user_ids.index_select(0, rows), user_dense.index_select(0, rows)
        fields = torch.cat([self.user_emb(user_ids), self.cand_emb(cand_ids)], dim=1)  # [B, F, E]
        dense = torch.cat([user_dense, cand_dense], dim=-1)
        linear = torch.cat([self.user_linear(user_ids), self.cand_linear(cand_ids)], dim=1).sum(dim=1)
        logit = linear + self.dense_linear(dense) + self.fm(fields)
        deep = self.dnn(torch.cat([fields.flatten(start_dim=1), dense], dim=-1))
        return torch.sigmoid(logit + self.dnn_linear(deep))


# ----------------------------------------------------------------------------- Wide & Deep


class WideDeep(nn.Module):
    """Wide & Deep (Cheng et al. 2016): a wide linear model over dense features and a crossed
    user × item-category feature, and a deep MLP over embeddings. Replicates with `x[cand_to_user.long()]`."""

    CROSS = 10_007

    def __init__(self, dims: Dims = Dims()):
        super().__init__()
        self.dims = dims
        E = dims.emb
        self.wide_dense = nn.Linear(dims.user_dense + dims.cand_dense, 1)
        self.wide_cross = nn.Embedding(self.CROSS, 1)
        self.user_emb, self.cand_emb = nn.Embedding(dims.user_vocab, E), nn.Embedding(dims.cand_vocab, E)
        self.deep = nn.Sequential(
            nn.Linear(dims.user_fields * E + dims.user_dense + dims.cand_fields * E + dims.cand_dense, 256),
            nn.ReLU(), nn.Dropout(0.5),
            nn.Linear(256, 128), nn.ReLU(), nn.Dropout(0.5), nn.Linear(128, 1),
        )  # fmt: skip

    def forward(self, user_ids, user_dense, cand_ids, cand_dense, cand_to_user):
        rows = cand_to_user.long()
        user_ids, user_dense = user_ids[rows], user_dense[rows]
        crossed = (user_ids[:, 0] * self.dims.cand_vocab + cand_ids[:, 0]) % self.CROSS
        wide = self.wide_dense(torch.cat([user_dense, cand_dense], dim=1)) + self.wide_cross(crossed)
        deep_in = torch.cat(
            [self.user_emb(user_ids).flatten(1), user_dense, self.cand_emb(cand_ids).flatten(1), cand_dense], dim=1
        )
        return torch.sigmoid(wide + self.deep(deep_in))


# ----------------------------------------------------------------------------- MMoE and PLE


class MMoE(nn.Module):
    """Multi-gate mixture of experts (Ma et al. 2018): shared experts, a softmax gate and a tower per
    task (towers with BatchNorm and Dropout). Replicates with `torch.index_select`."""

    def __init__(self, experts=4, expert_dim=64, dims: Dims = Dims()):
        super().__init__()
        self.dims = dims
        E = dims.emb
        self.user_emb, self.cand_emb = nn.Embedding(dims.user_vocab, E), nn.Embedding(dims.cand_vocab, E)
        dim = dims.user_fields * E + dims.user_dense + dims.cand_fields * E + dims.cand_dense
        self.experts = nn.ModuleList(mlp((dim, 128, expert_dim), norm=None) for _ in range(experts))
        self.gates = nn.ModuleList(nn.Linear(dim, experts) for _ in range(dims.tasks))
        self.towers = nn.ModuleList(
            nn.Sequential(mlp((expert_dim, 32), norm="bn"), nn.Linear(32, 1)) for _ in range(dims.tasks)
        )

    def forward(self, user_ids, user_dense, cand_ids, cand_dense, cand_to_user):
        rows = cand_to_user.long()
        user = torch.cat([self.user_emb(user_ids).flatten(1), user_dense], dim=1)
        x = torch.cat([torch.index_select(user, 0, rows), self.cand_emb(cand_ids).flatten(1), cand_dense], dim=1)
        expert_outs = torch.stack([expert(x) for expert in self.experts], dim=1)  # [B, X, H]
        outs = []
        for gate, tower in zip(self.gates, self.towers):
            weights = torch.softmax(gate(x), dim=-1).unsqueeze(-1)  # [B, X, 1]
            outs.append(torch.sigmoid(tower((expert_outs * weights).sum(dim=1))))
        return torch.cat(outs, dim=1)


class CGC(nn.Module):
    """One customized gate control layer of PLE: task-specific and shared experts, a gate per task
    (and one for the shared output when another layer follows)."""

    def __init__(self, dim, expert_dim, tasks, specific=2, shared=2, last=False):
        super().__init__()
        self.specific, self.shared, self.last = specific, shared, last

        def experts(n):
            return nn.ModuleList(mlp((dim, expert_dim), norm=None) for _ in range(n))

        self.task_experts = nn.ModuleList(experts(specific) for _ in range(tasks))
        self.shared_experts = experts(shared)
        self.task_gates = nn.ModuleList(nn.Linear(dim, specific + shared) for _ in range(tasks))
        self.shared_gate = None if last else nn.Linear(dim, tasks * specific + shared)

    def forward(self, task_inputs, shared_input):
        shared = [e(shared_input) for e in self.shared_experts]
        outs, all_specific = [], []
        for x, experts, gate in zip(task_inputs, self.task_experts, self.task_gates):
            specific = [e(x) for e in experts]
            all_specific += specific
            stacked = torch.stack(specific + shared, dim=1)  # [B, n, H]
            weights = F.softmax(gate(x), dim=1).unsqueeze(1)  # [B, 1, n]
            outs.append(torch.bmm(weights, stacked).squeeze(1))
        if self.shared_gate is not None:
            stacked = torch.stack(all_specific + shared, dim=1)
            weights = F.softmax(self.shared_gate(shared_input), dim=1).unsqueeze(1)
            outs.append(torch.bmm(weights, stacked).squeeze(1))
        return outs


class PLE(nn.Module):
    """Progressive layered extraction (Tang et al. 2020): two CGC layers and a tower per task.
    Replicates with `x[cand_to_user, :]`."""

    def __init__(self, expert_dim=64, dims: Dims = Dims()):
        super().__init__()
        self.dims = dims
        E, tasks = dims.emb, dims.tasks
        self.user_emb, self.cand_emb = nn.Embedding(dims.user_vocab, E), nn.Embedding(dims.cand_vocab, E)
        dim = dims.user_fields * E + dims.user_dense + dims.cand_fields * E + dims.cand_dense
        self.layers = nn.ModuleList([CGC(dim, expert_dim, tasks), CGC(expert_dim, expert_dim, tasks, last=True)])
        self.towers = nn.ModuleList(
            nn.Sequential(nn.Linear(expert_dim, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 1)) for _ in range(tasks)
        )

    def forward(self, user_ids, user_dense, cand_ids, cand_dense, cand_to_user):
        user = torch.cat([self.user_emb(user_ids).flatten(1), user_dense], dim=1)[cand_to_user, :]
        x = torch.cat([user, self.cand_emb(cand_ids).flatten(1), cand_dense], dim=1)
        tasks = self.dims.tasks
        task_inputs, shared = [x] * tasks, x
        for layer in self.layers:
            outs = layer(task_inputs, shared)
            task_inputs, shared = outs[:tasks], outs[-1]
        return torch.cat([torch.sigmoid(t(x)) for t, x in zip(self.towers, task_inputs)], dim=1)


# ----------------------------------------------------------------------------- attention over the history


class TargetMHA(nn.Module):
    """Target attention with `nn.MultiheadAttention` (sequence-first, as its default): the candidate
    attends to the user's history with a key padding mask, residual + LayerNorm and a feed-forward
    block, then an MLP. Replicates the embedded history with `x[cand_to_user]`."""

    def __init__(self, dims: Dims = Dims()):
        super().__init__()
        self.dims = dims
        E = dims.emb
        self.item_emb, self.user_emb = nn.Embedding(dims.item_vocab, E), nn.Embedding(dims.user_vocab, E)
        self.pos_emb = nn.Embedding(dims.history, E)
        self.mha = nn.MultiheadAttention(E, dims.heads, dropout=0.1)
        self.norm1, self.norm2 = nn.LayerNorm(E), nn.LayerNorm(E)
        self.ffn = nn.Sequential(nn.Linear(E, 4 * E), nn.GELU(), nn.Dropout(0.1), nn.Linear(4 * E, E))
        self.dnn = mlp((2 * E + dims.user_fields * E, *dims.hidden), norm="ln")
        self.out = nn.Linear(dims.hidden[-1], 1)

    def forward(self, user_ids, hist_items, hist_len, cand_items, cand_to_user):
        positions = torch.arange(hist_items.shape[1], device=hist_items.device)
        hist = self.item_emb(hist_items) + self.pos_emb(positions)  # [U, L, E]
        hist, hist_len = hist[cand_to_user], hist_len[cand_to_user]
        padding = positions.unsqueeze(0) >= hist_len.unsqueeze(1)  # [B, L]
        target = self.item_emb(cand_items)  # [B, E]
        kv = hist.transpose(0, 1)  # [L, B, E]
        attended, _ = self.mha(target.unsqueeze(0), kv, kv, key_padding_mask=padding)
        x = self.norm1(target + attended.squeeze(0))
        x = self.norm2(x + self.ffn(x))
        user = self.user_emb(user_ids)[cand_to_user].flatten(1)
        return torch.sigmoid(self.out(self.dnn(torch.cat([x, target, user], dim=-1))))


class SIM(nn.Module):
    """Search-based interest model (Pi et al. 2020), soft search: the general search unit scores the
    long history against the target and keeps the top K; the exact search unit attends over them with
    multi-head attention; a short-term attention over the recent history beside it. Replicates with
    `torch.index_select`."""

    def __init__(self, dims: Dims = Dims()):
        super().__init__()
        self.dims = dims
        E = dims.emb
        self.item_emb, self.user_emb = nn.Embedding(dims.item_vocab, E), nn.Embedding(dims.user_vocab, E)
        self.search = nn.Linear(E, E, bias=False)
        self.esu = nn.MultiheadAttention(E, dims.heads, batch_first=True)
        self.short = nn.MultiheadAttention(E, dims.heads, batch_first=True)
        self.dnn = mlp((3 * E + dims.user_fields * E, *dims.hidden), norm="bn")
        self.out = nn.Linear(dims.hidden[-1], 1)

    def forward(self, user_ids, long_items, long_len, hist_items, hist_len, cand_items, cand_to_user):
        rows = cand_to_user.long()
        long_seq = torch.index_select(self.item_emb(long_items), 0, rows)  # [B, LL, E]
        long_len = torch.index_select(long_len, 0, rows)
        target = self.item_emb(cand_items)  # [B, E]
        relevance = torch.bmm(long_seq, self.search(target).unsqueeze(-1)).squeeze(-1)  # [B, LL]
        valid = torch.arange(long_seq.size(1), device=long_seq.device) < long_len.unsqueeze(-1)
        relevance = relevance.masked_fill(~valid, -1e9)
        top = relevance.topk(self.dims.topk, dim=1).indices  # [B, K]
        selected = torch.gather(long_seq, 1, top.unsqueeze(-1).expand(-1, -1, long_seq.size(-1)))
        query = target.unsqueeze(1)
        long_interest, _ = self.esu(query, selected, selected)
        short_seq = torch.index_select(self.item_emb(hist_items), 0, rows)
        short_pad = torch.arange(short_seq.size(1), device=rows.device) >= hist_len.index_select(0, rows)[:, None]
        short_interest, _ = self.short(query, short_seq, short_seq, key_padding_mask=short_pad)
        user = self.user_emb(user_ids).flatten(1).index_select(0, rows)
        x = torch.cat([long_interest.squeeze(1), short_interest.squeeze(1), target, user], dim=-1)
        return torch.sigmoid(self.out(self.dnn(x)))


class HSTUBlock(nn.Module):
    """A hierarchical sequential transduction unit (Zhai et al. 2024, generative-recommenders `HSTU`):
    U, V, Q, K from one SiLU projection, pointwise SiLU attention with a relative position bias and a
    causal mask, normalized and gated by U."""

    def __init__(self, dim, heads, max_len):
        super().__init__()
        self.heads, self.dim = heads, dim
        self.uvqk = nn.Linear(dim, 4 * dim)
        self.rab = nn.Parameter(torch.zeros(heads, max_len, max_len))
        self.norm_in, self.norm_attn = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.out = nn.Linear(dim, dim)
        self.dropout = nn.Dropout(0.2)

    def forward(self, x, valid):  # x [N, n, D], valid [N, n] bool
        n = x.shape[1]
        u, v, q, k = torch.split(F.silu(self.uvqk(self.norm_in(x))), self.dim, dim=-1)
        q, k, v = (t.unflatten(-1, (self.heads, -1)).transpose(1, 2) for t in (q, k, v))  # [N, h, n, d]
        causal = torch.tril(torch.ones(n, n, dtype=torch.bool, device=x.device))
        mask = causal & valid[:, None, None, :]
        attn = F.silu(torch.einsum("bhnd,bhmd->bhnm", q, k) + self.rab[:, :n, :n]) / n
        attn = attn * mask
        y = torch.einsum("bhnm,bhmd->bhnd", attn, v).transpose(1, 2).flatten(2)
        return x + self.out(self.dropout(self.norm_attn(y) * u))


class HSTURanker(nn.Module):
    """HSTU-style ranking: HSTU blocks over the user's history (causal), then the candidate attends to
    the block outputs with the same pointwise SiLU attention, and an MLP. Replicates with `x[cand_to_user]`."""

    def __init__(self, dims: Dims = Dims()):
        super().__init__()
        self.dims = dims
        E = dims.emb
        self.item_emb = nn.Embedding(dims.item_vocab, E)
        self.blocks = nn.ModuleList(HSTUBlock(E, dims.heads, dims.history) for _ in range(2))
        self.q, self.kv = nn.Linear(E, E), nn.Linear(E, 2 * E)
        self.dnn = mlp((2 * E, 128, 64), norm="ln")
        self.out = nn.Linear(64, 1)

    def forward(self, hist_items, hist_len, cand_items, cand_to_user):
        x, hist_len = self.item_emb(hist_items)[cand_to_user], hist_len[cand_to_user]
        valid = torch.arange(x.shape[1], device=x.device)[None, :] < hist_len[:, None]
        for block in self.blocks:
            x = block(x, valid)
        target = self.item_emb(cand_items)
        k, v = self.kv(x).chunk(2, dim=-1)  # [B, L, E]
        weights = F.silu(torch.einsum("bd,bnd->bn", self.q(target), k)) / x.shape[1]
        weights = weights * valid
        pooled = torch.einsum("bn,bnd->bd", weights, v)
        return torch.sigmoid(self.out(self.dnn(torch.cat([pooled, target], dim=-1))))


# ----------------------------------------------------------------------------- two towers


class TwoTower(nn.Module):
    """Two towers (user, item) with LayerNorm and Dropout, joined by a dot product and an interaction
    head over [u, v, u ⊙ v] (as in YouTube DNN-style rankers re-using retrieval towers). Replicates the
    user tower's output with `x[cand_to_user]`."""

    def __init__(self, dims: Dims = Dims()):
        super().__init__()
        self.dims = dims
        E = dims.emb
        self.user_emb, self.cand_emb = nn.Embedding(dims.user_vocab, E), nn.Embedding(dims.cand_vocab, E)
        self.user_tower = nn.Sequential(
            mlp((dims.user_fields * E + dims.user_dense, 256), norm="ln"), nn.Linear(256, 64)
        )
        self.item_tower = nn.Sequential(
            mlp((dims.cand_fields * E + dims.cand_dense, 256), norm="ln"), nn.Linear(256, 64)
        )
        self.head = nn.Sequential(mlp((3 * 64, 128), norm="bn"), nn.Linear(128, 1))

    def forward(self, user_ids, user_dense, cand_ids, cand_dense, cand_to_user):
        u = self.user_tower(torch.cat([self.user_emb(user_ids).flatten(1), user_dense], dim=1))[cand_to_user]
        v = self.item_tower(torch.cat([self.cand_emb(cand_ids).flatten(1), cand_dense], dim=1))
        u, v = F.normalize(u, dim=-1), F.normalize(v, dim=-1)
        dot = (u * v).sum(dim=-1, keepdim=True)
        return torch.sigmoid(dot + self.head(torch.cat([u, v, u * v], dim=-1)))


# ----------------------------------------------------------------------------- inputs


def _feature(name, num_users, num_candidates, gen, dims: Dims):
    """One input tensor by name (user tensors at U rows, candidate tensors at B rows) at `dims`."""
    U, B, d = num_users, num_candidates, dims
    L, LL = d.history, d.long_history

    def ints(high, *shape):
        return torch.randint(0, high, shape, generator=gen)

    table = {
        "user_ids": lambda: ints(d.user_vocab, U, d.user_fields),
        "user_dense": lambda: torch.randn(U, d.user_dense, generator=gen),
        "hist_items": lambda: ints(d.item_vocab, U, L),
        "hist_cats": lambda: ints(d.cat_vocab, U, L),
        "hist_len": lambda: torch.randint(1, L + 1, (U,), generator=gen),
        "long_items": lambda: ints(d.item_vocab, U, LL),
        "long_len": lambda: torch.randint(d.topk, LL + 1, (U,), generator=gen),
        "cand_items": lambda: ints(d.item_vocab, B),
        "cand_cats": lambda: ints(d.cat_vocab, B),
        "cand_ids": lambda: ints(d.cand_vocab, B, d.cand_fields),
        "cand_dense": lambda: torch.randn(B, d.cand_dense, generator=gen),
    }
    return table[name]()


def dims_of(model: nn.Module) -> Dims:
    """The sizes `model` was built with (`model.dims`; the small ones for a model without)."""
    return getattr(model, "dims", DIMS["small"])


def inputs(model: nn.Module, num_users: int, num_candidates: int, gen: torch.Generator, mapping=None) -> tuple:
    """A request for `model` (its forward's arguments in order) at its dims: random features and, unless
    given, a random unsorted `cand_to_user`."""
    names = list(model.forward.__code__.co_varnames[1 : model.forward.__code__.co_argcount])
    if mapping is None:
        mapping = torch.randint(0, num_users, (num_candidates,), generator=gen)
    dims = dims_of(model)
    return tuple(mapping if n == "cand_to_user" else _feature(n, num_users, num_candidates, gen, dims) for n in names)


MODELS = {
    "din": DIN,
    "dien": DIEN,
    "bst": BST,
    "dcn_v2": DCNv2,
    "deepfm": DeepFM,
    "wide_deep": WideDeep,
    "mmoe": MMoE,
    "ple": PLE,
    "target_mha": TargetMHA,
    "sim": SIM,
    "hstu": HSTURanker,
    "two_tower": TwoTower,
}


def build(name: str, seed: int = 0, models: dict | None = None, dims: Dims | None = None) -> nn.Module:
    """The zoo model `name` (of `models`, default `MODELS`) at `dims` (default `DIMS["small"]`) in eval mode
    with random weights (BatchNorm statistics randomized, so that eval-mode normalization is not the identity)."""
    torch.manual_seed(seed)
    model = (MODELS if models is None else models)[name](dims=DIMS["small"] if dims is None else dims)
    for module in model.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            module.running_mean.normal_(0, 0.5)
            module.running_var.uniform_(0.5, 2.0)
            nn.init.normal_(module.weight, 1.0, 0.2)
            nn.init.normal_(module.bias, 0.0, 0.2)
    return model.eval()
