"""More standard ranking models for trying `to_ikbo` on, beyond `zoo.py`: each written from its paper in the
idiom of a public implementation (DeepCTR-Torch, torchrec, FuxiCTR, the papers' reference code), without IKBO
in mind, and each replicating the user's features to candidate rows in another common spelling: a DeepCTR-style
feature matrix X built by concatenation, `torch.repeat_interleave` with per-user counts (candidates sorted by
user), a dict of tensors in and out, an index spread over three dims for `torch.gather`, `F.embedding` of the
mapping, and `Tensor.expand` of a one-user request.

Every model takes user tensors at U rows, candidate tensors at B rows and the mapping `cand_to_user` [B];
`MODELS[name]` gives the model class, `inputs(model, U, B, gen)` draws a request for it and
`build(name, seed, dims)` makes it (eval mode, BatchNorm statistics randomized). Its sizes are a `zoo.Dims`
(default `zoo.DIMS["small"]`), unlike the U and B of the tests.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
from torch import nn

from . import zoo
from .zoo import Dims, mlp

HIST_VOCAB = 500  # ids of the pooled watch history (EmbeddingBag)


def _dnn_input(sparse_embedding_list, dense_value_list):
    """DeepCTR-Torch `combined_dnn_input`: the flattened field embeddings, then the dense values."""
    sparse = torch.flatten(torch.cat(sparse_embedding_list, dim=-1), start_dim=1)
    dense = torch.flatten(torch.cat(dense_value_list, dim=-1), start_dim=1)
    return torch.cat([sparse, dense], dim=-1)


class DeepCTRInput(nn.Module):
    """The DeepCTR-Torch input layer: one float matrix X [B, fields] holding sparse ids (as floats) and dense
    values, sliced per feature (`X[:, i:i + 1].long()` into an embedding per field). Here X is made by
    concatenating the user's row of X, replicated with `x[cand_to_user]`, and the candidate's."""

    def __init__(self, dims: Dims):
        super().__init__()
        UF, UD, CF, CD = dims.user_fields, dims.user_dense, dims.cand_fields, dims.cand_dense
        vocabs = [dims.user_vocab] * UF + [dims.cand_vocab] * CF
        self.embedding_dict = nn.ModuleDict({f"s{i}": nn.Embedding(v, dims.emb) for i, v in enumerate(vocabs)})
        self.linear_dict = nn.ModuleDict({f"s{i}": nn.Embedding(v, 1) for i, v in enumerate(vocabs)})
        self.dense_weight = nn.Parameter(torch.randn(UD + CD, 1) * 0.01)
        self.sparse_fields, self.dense_fields = UF + CF, UD + CD
        # column layout of X: user ids, user dense, candidate ids, candidate dense
        self.sparse_cols = list(range(UF)) + list(range(UF + UD, UF + UD + CF))
        self.dense_cols = list(range(UF, UF + UD)) + list(range(UF + UD + CF, UF + UD + CF + CD))

    def forward(self, X):
        sparse = [self.embedding_dict[f"s{i}"](X[:, c : c + 1].long()) for i, c in enumerate(self.sparse_cols)]
        dense = [X[:, c : c + 1] for c in self.dense_cols]
        linear_sparse = [self.linear_dict[f"s{i}"](X[:, c : c + 1].long()) for i, c in enumerate(self.sparse_cols)]
        linear = torch.sum(torch.cat(linear_sparse, dim=-1), dim=-1, keepdim=False)  # [B, 1]
        linear = linear + torch.cat(dense, dim=-1).matmul(self.dense_weight)
        return sparse, dense, linear


def _feature_matrix(user_ids, user_dense, cand_ids, cand_dense, cand_to_user):
    """X = [user ids, user dense, candidate ids, candidate dense] per candidate (ids as floats)."""
    user = torch.cat([user_ids.float(), user_dense], dim=1)[cand_to_user]
    return torch.cat([user, cand_ids.float(), cand_dense], dim=1)


# ----------------------------------------------------------------------------- xDeepFM


class CIN(nn.Module):
    """Compressed interaction network (Lian et al. 2018; DeepCTR-Torch `layers.interaction.CIN`): the outer
    product of the previous layer's feature maps with the field embeddings, compressed by a 1×1 Conv1d."""

    def __init__(self, field_size, layer_size=(64, 32), split_half=True):
        super().__init__()
        self.layer_size, self.split_half = layer_size, split_half
        self.field_nums = [field_size]
        self.conv1ds = nn.ModuleList()
        for i, size in enumerate(layer_size):
            self.conv1ds.append(nn.Conv1d(self.field_nums[-1] * self.field_nums[0], size, 1))
            self.field_nums.append(size // 2 if split_half and i != len(layer_size) - 1 else size)
        self.activation = nn.ReLU()

    def forward(self, inputs):
        if len(inputs.shape) != 3:
            raise ValueError(f"Unexpected inputs dimensions {len(inputs.shape)}, expect to be 3 dimensions")
        batch_size = inputs.shape[0]
        dim = inputs.shape[-1]
        hidden_nn_layers = [inputs]
        final_result = []
        for i, size in enumerate(self.layer_size):
            x = torch.einsum("bhd,bmd->bhmd", hidden_nn_layers[-1], hidden_nn_layers[0])
            x = x.reshape(batch_size, hidden_nn_layers[-1].shape[1] * hidden_nn_layers[0].shape[1], dim)
            curr_out = self.activation(self.conv1ds[i](x))
            if self.split_half and i != len(self.layer_size) - 1:
                next_hidden, direct_connect = torch.split(curr_out, 2 * [size // 2], 1)
            else:
                direct_connect, next_hidden = curr_out, 0
            final_result.append(direct_connect)
            hidden_nn_layers.append(next_hidden)
        result = torch.cat(final_result, dim=1)
        return torch.sum(result, -1)


class XDeepFM(nn.Module):
    """xDeepFM (Lian et al. 2018): a linear part, a CIN over the field embeddings and a DNN with BatchNorm, in
    DeepCTR-Torch's layout (one feature matrix X). Replicates the user's row of X with `x[cand_to_user]`."""

    def __init__(self, dims: Dims = Dims()):
        super().__init__()
        self.dims = dims
        self.features = DeepCTRInput(dims)
        fields = dims.user_fields + dims.cand_fields
        self.cin = CIN(fields)
        self.cin_linear = nn.Linear(32 + 32, 1, bias=False)
        self.dnn = mlp((fields * dims.emb + dims.user_dense + dims.cand_dense, *dims.hidden), norm="bn")
        self.dnn_linear = nn.Linear(dims.hidden[-1], 1, bias=False)

    def forward(self, user_ids, user_dense, cand_ids, cand_dense, cand_to_user):
        X = _feature_matrix(user_ids, user_dense, cand_ids, cand_dense, cand_to_user)
        sparse, dense, logit = self.features(X)
        cin_input = torch.cat(sparse, dim=1)  # [B, F, E]
        logit = logit + self.cin_linear(self.cin(cin_input))
        logit = logit + self.dnn_linear(self.dnn(_dnn_input(sparse, dense)))
        return torch.sigmoid(logit)


# ----------------------------------------------------------------------------- AutoInt


class InteractingLayer(nn.Module):
    """Multi-head self-attention over the field embeddings (Song et al. 2019; DeepCTR-Torch
    `InteractingLayer`: tensordot projections, heads stacked on dim 0, residual, ReLU)."""

    def __init__(self, embedding_size, head_num, use_res=True, scaling=True):
        super().__init__()
        self.att_embedding_size = embedding_size // head_num
        self.head_num, self.use_res, self.scaling = head_num, use_res, scaling
        for name in ("W_Query", "W_key", "W_Value", "W_Res"):
            setattr(self, name, nn.Parameter(torch.randn(embedding_size, embedding_size) * 0.05))

    def forward(self, inputs):
        querys = torch.tensordot(inputs, self.W_Query, dims=([-1], [0]))
        keys = torch.tensordot(inputs, self.W_key, dims=([-1], [0]))
        values = torch.tensordot(inputs, self.W_Value, dims=([-1], [0]))
        querys = torch.stack(torch.split(querys, self.att_embedding_size, dim=2))  # [H, B, F, d]
        keys = torch.stack(torch.split(keys, self.att_embedding_size, dim=2))
        values = torch.stack(torch.split(values, self.att_embedding_size, dim=2))
        inner_product = torch.einsum("bnik,bnjk->bnij", querys, keys)  # [H, B, F, F]
        if self.scaling:
            inner_product = inner_product / self.att_embedding_size**0.5
        attention = F.softmax(inner_product, dim=-1)
        result = torch.matmul(attention, values)  # [H, B, F, d]
        result = torch.cat(torch.split(result, 1), dim=-1)
        result = torch.squeeze(result, dim=0)  # [B, F, E]
        if self.use_res:
            result = result + torch.tensordot(inputs, self.W_Res, dims=([-1], [0]))
        return F.relu(result)


class AutoInt(nn.Module):
    """AutoInt+ (Song et al. 2019): interacting layers over the embeddings of the user's and the candidate's
    fields, beside a DNN with BatchNorm. Replicates the user's field embeddings with `torch.gather` over an
    index spread to [B, F, E]."""

    def __init__(self, layers=2, dims: Dims = Dims()):
        super().__init__()
        self.dims = dims
        E = dims.emb
        self.user_emb, self.cand_emb = nn.Embedding(dims.user_vocab, E), nn.Embedding(dims.cand_vocab, E)
        self.int_layers = nn.ModuleList(InteractingLayer(E, dims.heads) for _ in range(layers))
        fields = dims.user_fields + dims.cand_fields
        self.dnn = mlp((fields * E + dims.user_dense + dims.cand_dense, *dims.hidden), norm="bn")
        self.dnn_linear = nn.Linear(fields * E + dims.hidden[-1], 1, bias=False)

    def forward(self, user_ids, user_dense, cand_ids, cand_dense, cand_to_user):
        user = self.user_emb(user_ids)  # [U, UF, E]
        index = cand_to_user.view(-1, 1, 1).expand(-1, user.shape[1], user.shape[2])
        att_input = torch.cat([torch.gather(user, 0, index), self.cand_emb(cand_ids)], dim=1)  # [B, F, E]
        dense = torch.cat([user_dense[cand_to_user], cand_dense], dim=-1)
        att = att_input
        for layer in self.int_layers:
            att = layer(att)
        deep = self.dnn(torch.cat([att_input.flatten(1), dense], dim=-1))
        return torch.sigmoid(self.dnn_linear(torch.cat([torch.flatten(att, start_dim=1), deep], dim=-1)))


# ----------------------------------------------------------------------------- FiBiNET


class SENETLayer(nn.Module):
    """Squeeze-excitation over fields (Huang et al. 2019; DeepCTR-Torch `SENETLayer`)."""

    def __init__(self, filed_size, reduction_ratio=3):
        super().__init__()
        reduction_size = max(1, filed_size // reduction_ratio)
        self.excitation = nn.Sequential(
            nn.Linear(filed_size, reduction_size, bias=False), nn.ReLU(),
            nn.Linear(reduction_size, filed_size, bias=False), nn.ReLU(),
        )  # fmt: skip

    def forward(self, inputs):
        if len(inputs.shape) != 3:
            raise ValueError(f"Unexpected inputs dimensions {len(inputs.shape)}, expect to be 3 dimensions")
        Z = torch.mean(inputs, dim=-1, out=None)
        A = self.excitation(Z)
        return torch.mul(inputs, torch.unsqueeze(A, dim=2))


class BilinearInteraction(nn.Module):
    """Bilinear feature interaction, one matrix per field pair (DeepCTR-Torch `BilinearInteraction`,
    bilinear_type="interaction")."""

    def __init__(self, filed_size, embedding_size):
        super().__init__()
        pairs = itertools.combinations(range(filed_size), 2)
        self.bilinear = nn.ModuleList(nn.Linear(embedding_size, embedding_size, bias=False) for _ in pairs)

    def forward(self, inputs):
        inputs = torch.split(inputs, 1, dim=1)
        p = [torch.mul(bilinear(v[0]), v[1]) for v, bilinear in zip(itertools.combinations(inputs, 2), self.bilinear)]
        return torch.cat(p, dim=1)


class FiBiNET(nn.Module):
    """FiBiNET (Huang et al. 2019): SENET re-weights the field embeddings, bilinear interactions of the raw and
    re-weighted fields feed a DNN with BatchNorm, beside a linear part, in DeepCTR-Torch's layout. Replicates the
    user's row of X with `x[cand_to_user]`."""

    def __init__(self, dims: Dims = Dims()):
        super().__init__()
        self.dims = dims
        fields = dims.user_fields + dims.cand_fields
        self.features = DeepCTRInput(dims)
        self.SE = SENETLayer(fields)
        self.Bilinear = BilinearInteraction(fields, dims.emb)
        pairs = fields * (fields - 1) // 2
        self.dnn = mlp((2 * pairs * dims.emb + dims.user_dense + dims.cand_dense, *dims.hidden), norm="bn")
        self.dnn_linear = nn.Linear(dims.hidden[-1], 1, bias=False)

    def forward(self, user_ids, user_dense, cand_ids, cand_dense, cand_to_user):
        X = _feature_matrix(user_ids, user_dense, cand_ids, cand_dense, cand_to_user)
        sparse, dense, logit = self.features(X)
        sparse_embedding_input = torch.cat(sparse, dim=1)
        senet_output = self.SE(sparse_embedding_input)
        senet_bilinear_out = self.Bilinear(senet_output)
        bilinear_out = self.Bilinear(sparse_embedding_input)
        dnn_input = _dnn_input([torch.flatten(torch.cat([senet_bilinear_out, bilinear_out], dim=1), 1)], dense)
        return torch.sigmoid(logit + self.dnn_linear(self.dnn(dnn_input)))


# ----------------------------------------------------------------------------- DLRM


class DLRM(nn.Module):
    """DLRM (Naumov et al. 2019; torchrec `DLRM`): a bottom MLP over the dense features, the pairwise dot
    products of the dense vector and every sparse embedding (`InteractionArch`: bmm, upper triangle by
    `triu_indices`), a top MLP over [dense, interactions]. The dense features and half the sparse fields are
    the user's: replicated with `torch.repeat_interleave(x, counts, dim=0)` (candidates sorted by user)."""

    sorted_mapping = True

    def __init__(self, dims: Dims = Dims()):
        super().__init__()
        self.dims = dims
        E = dims.emb
        self.user_emb, self.cand_emb = nn.Embedding(dims.user_vocab, E), nn.Embedding(dims.cand_vocab, E)
        self.dense_arch = nn.Sequential(nn.Linear(dims.user_dense, 64), nn.ReLU(), nn.Linear(64, E), nn.ReLU())
        features = 1 + dims.user_fields + dims.cand_fields
        self.register_buffer("triu_indices", torch.triu_indices(features, features, offset=1), persistent=False)
        self.over_arch = nn.Sequential(
            nn.Linear(E + features * (features - 1) // 2, 256), nn.ReLU(), nn.Linear(256, 64), nn.ReLU(),
            nn.Linear(64, 1),
        )  # fmt: skip

    def forward(self, user_dense, user_ids, cand_ids, cand_to_user):
        counts = torch.bincount(cand_to_user, minlength=user_dense.shape[0])
        dense_features = torch.repeat_interleave(self.dense_arch(user_dense), counts, dim=0)  # [B, E]
        user_sparse = torch.repeat_interleave(self.user_emb(user_ids), counts, dim=0)  # [B, UF, E]
        sparse_features = torch.cat([user_sparse, self.cand_emb(cand_ids)], dim=1)  # [B, F, E]
        combined_values = torch.cat((dense_features.unsqueeze(1), sparse_features), dim=1)
        interactions = torch.bmm(combined_values, torch.transpose(combined_values, 1, 2))
        interactions_flat = interactions[:, self.triu_indices[0], self.triu_indices[1]]
        return self.over_arch(torch.cat((dense_features, interactions_flat), dim=1))


# ----------------------------------------------------------------------------- ESMM


class ESMM(nn.Module):
    """Entire-space multi-task model (Ma et al. 2018): CTR and CVR towers (BatchNorm, Dropout) over the same
    shared embeddings; pCTCVR = pCTR · pCVR. Takes and returns dicts of tensors; replicates with
    `features["user_ids"][features["cand_to_user"]]`."""

    def __init__(self, dims: Dims = Dims()):
        super().__init__()
        self.dims = dims
        E, hidden = dims.emb, dims.hidden
        self.user_emb, self.cand_emb = nn.Embedding(dims.user_vocab, E), nn.Embedding(dims.cand_vocab, E)
        dim = (dims.user_fields + dims.cand_fields) * E + dims.user_dense + dims.cand_dense
        self.ctr = nn.Sequential(mlp((dim, *hidden), norm="bn", dropout=0.3), nn.Linear(hidden[-1], 1))
        self.cvr = nn.Sequential(mlp((dim, *hidden), norm="bn", dropout=0.3), nn.Linear(hidden[-1], 1))

    def forward(self, features: dict):
        m = features["cand_to_user"]
        user = torch.cat([self.user_emb(features["user_ids"][m]).flatten(1), features["user_dense"][m]], dim=-1)
        cand = torch.cat([self.cand_emb(features["cand_ids"]).flatten(1), features["cand_dense"]], dim=-1)
        x = torch.cat([user, cand], dim=-1)
        p_ctr, p_cvr = torch.sigmoid(self.ctr(x)).squeeze(-1), torch.sigmoid(self.cvr(x)).squeeze(-1)
        return {"ctr": p_ctr, "cvr": p_cvr, "ctcvr": p_ctr * p_cvr}


# ----------------------------------------------------------------------------- CAN


class CoAction(nn.Module):
    """Co-action unit (Bian et al. 2022, CAN): the candidate's co-action embedding is unpacked into the weights
    and biases of a small MLP, applied to each history item's co-action embedding, with multi-order inputs
    (x, x²); the outputs summed over the valid history."""

    def __init__(self, dim=8, hidden=(8, 4), orders=2):
        super().__init__()
        self.dim, self.hidden, self.orders = dim, hidden, orders
        widths = (dim, *hidden)
        self.shapes = [(a, b) for a, b in zip(widths[:-1], widths[1:])]
        self.param_size = sum(a * b + b for a, b in self.shapes)

    def forward(self, item_param, hist, mask):  # item_param [B, P], hist [B, L, dim], mask [B, L]
        outs = []
        for order in range(1, self.orders + 1):
            h = hist**order
            offset = 0
            for a, b in self.shapes:
                weight = item_param[:, offset : offset + a * b].view(-1, a, b)
                offset += a * b
                bias = item_param[:, offset : offset + b].unsqueeze(1)
                offset += b
                h = torch.tanh(torch.bmm(h, weight) + bias)
            outs.append((h * mask.unsqueeze(-1)).sum(dim=1))
        return torch.cat(outs, dim=-1)


class CAN(nn.Module):
    """Co-Action Network (Bian et al. 2022): co-action units between the candidate and the user's history and
    profile, beside a DIN-style sum-pooled history and a DNN with BatchNorm. Replicates with `F.embedding` of
    the mapping (the user rows as the table)."""

    def __init__(self, dims: Dims = Dims()):
        super().__init__()
        self.dims = dims
        E, IV = dims.emb, dims.item_vocab
        self.co_action = CoAction()
        self.item_param = nn.Embedding(IV, self.co_action.param_size)
        self.item_co = nn.Embedding(IV, self.co_action.dim)
        self.item_emb, self.user_emb = nn.Embedding(IV, E), nn.Embedding(dims.user_vocab, E)
        out = self.co_action.orders * self.co_action.hidden[-1]
        self.dnn = mlp((dims.user_fields * E + 2 * E + 2 * out, *dims.hidden), norm="bn")
        self.out = nn.Linear(dims.hidden[-1], 1)

    def forward(self, user_ids, hist_items, hist_len, cand_items, cand_to_user):
        valid = (torch.arange(hist_items.shape[1])[None, :] < hist_len[:, None]).float()  # [U, L]
        hist_co = F.embedding(cand_to_user, self.item_co(hist_items).flatten(1)).unflatten(1, (self.dims.history, -1))
        mask = F.embedding(cand_to_user, valid)
        param = self.item_param(cand_items)  # [B, P]
        co_hist = self.co_action(param, hist_co, mask)
        profile = F.embedding(cand_to_user, self.item_co(user_ids).flatten(1)).unflatten(1, (self.dims.user_fields, -1))
        co_profile = self.co_action(param, profile, torch.ones_like(profile[..., 0]))
        pooled = F.embedding(cand_to_user, (self.item_emb(hist_items) * valid.unsqueeze(-1)).sum(1))
        user = F.embedding(cand_to_user, self.user_emb(user_ids).flatten(1))
        x = torch.cat([user, pooled, self.item_emb(cand_items), co_hist, co_profile], dim=-1)
        return torch.sigmoid(self.out(self.dnn(x)))


# ----------------------------------------------------------------------------- decoder over the history


class HistoryDecoder(nn.Module):
    """The candidate as the target of an `nn.TransformerDecoderLayer` (pre-norm, GELU) whose memory is the
    user's history with position embeddings and a key padding mask (as in generative-retrieval rankers),
    then an MLP with SiLU. Replicates the embedded history with `x[cand_to_user]`."""

    def __init__(self, dims: Dims = Dims()):
        super().__init__()
        self.dims = dims
        E = dims.emb
        self.item_emb, self.user_emb = nn.Embedding(dims.item_vocab, E), nn.Embedding(dims.user_vocab, E)
        self.pos_emb = nn.Embedding(dims.history, E)
        self.cand_proj = nn.Linear(E + dims.cand_dense, E)
        self.decoder = nn.TransformerDecoderLayer(
            E, dims.heads, dim_feedforward=2 * E, dropout=0.1, activation="gelu", batch_first=True, norm_first=True
        )
        self.dnn = mlp((E + dims.user_fields * E, 128, 64), norm="ln", act=nn.SiLU)
        self.out = nn.Linear(64, 1)

    def forward(self, user_ids, hist_items, hist_len, cand_items, cand_dense, cand_to_user):
        positions = torch.arange(hist_items.shape[1], device=hist_items.device)
        memory = (self.item_emb(hist_items) + self.pos_emb(positions))[cand_to_user]  # [B, L, E]
        padding = (positions[None, :] >= hist_len[:, None])[cand_to_user]
        tgt = self.cand_proj(torch.cat([self.item_emb(cand_items), cand_dense], dim=-1)).unsqueeze(1)
        out = self.decoder(tgt, memory, memory_key_padding_mask=padding).squeeze(1)
        user = self.user_emb(user_ids).flatten(1)[cand_to_user]
        return torch.sigmoid(self.out(self.dnn(torch.cat([out, user], dim=-1))))


# ----------------------------------------------------------------------------- YouTube DNN


class YouTubeDNN(nn.Module):
    """YouTube DNN ranking (Covington et al. 2016): the watch history mean-pooled by an `nn.EmbeddingBag` over
    ragged ids with offsets, the user's features, then per candidate a tower with LayerNorm after the
    concatenation and GELU. Replicates with `torch.repeat_interleave(x, counts, dim=0)` (sorted candidates)."""

    sorted_mapping = True

    def __init__(self, dims: Dims = Dims()):
        super().__init__()
        self.dims = dims
        E = dims.emb
        self.watch = nn.EmbeddingBag(HIST_VOCAB, E, mode="mean")
        self.user_emb, self.cand_emb = nn.Embedding(dims.user_vocab, E), nn.Embedding(dims.cand_vocab, E)
        dim = E + dims.user_fields * E + dims.user_dense + dims.cand_fields * E + dims.cand_dense
        self.norm = nn.LayerNorm(dim)
        self.tower = nn.Sequential(nn.Linear(dim, 256), nn.GELU(), nn.Linear(256, 64), nn.GELU(), nn.Linear(64, 1))

    def forward(self, watch_ids, watch_offsets, user_ids, user_dense, cand_ids, cand_dense, cand_to_user):
        watched = self.watch(watch_ids, watch_offsets)  # [U, E]
        user = torch.cat([watched, self.user_emb(user_ids).flatten(1), user_dense], dim=1)
        counts = torch.bincount(cand_to_user, minlength=user.shape[0])
        user = user.repeat_interleave(counts, dim=0)
        x = torch.cat([user, self.cand_emb(cand_ids).flatten(1), cand_dense], dim=1)
        return torch.sigmoid(self.tower(self.norm(x)))


# ----------------------------------------------------------------------------- target attention with SDPA


class CosineTargetAttention(nn.Module):
    """Target attention written with `F.scaled_dot_product_attention` and an additive float key mask
    ((1 − valid) · −10000, as BERT-style code spells it), beside a cosine-similarity pooling of the history
    (`F.normalize`, `einsum`), an MLP with LayerNorm and SiLU. Replicates with `torch.gather` over an index
    spread to [B, L, E] and the mask with `index_select`."""

    def __init__(self, dims: Dims = Dims()):
        super().__init__()
        self.dims = dims
        E = dims.emb
        self.item_emb, self.user_emb = nn.Embedding(dims.item_vocab, E), nn.Embedding(dims.user_vocab, E)
        self.q, self.k, self.v = nn.Linear(E + dims.cand_dense, E), nn.Linear(E, E), nn.Linear(E, E)
        self.dnn = mlp((3 * E + dims.user_fields * E, *dims.hidden), norm="ln", act=nn.SiLU)
        self.out = nn.Linear(dims.hidden[-1], 1)

    def forward(self, user_ids, hist_items, hist_len, cand_items, cand_dense, cand_to_user):
        hist = self.item_emb(hist_items)  # [U, L, E]
        index = cand_to_user[:, None, None].expand(-1, hist.size(1), hist.size(2))
        keys = torch.gather(hist, 0, index)  # [B, L, E]
        valid = (torch.arange(hist.size(1)) < hist_len.unsqueeze(1)).float().index_select(0, cand_to_user)
        target = self.item_emb(cand_items)
        H, d = self.dims.heads, self.dims.emb // self.dims.heads
        q = self.q(torch.cat([target, cand_dense], dim=-1)).view(-1, H, 1, d)
        k = self.k(keys).view(keys.size(0), -1, H, d).transpose(1, 2)
        v = self.v(keys).view(keys.size(0), -1, H, d).transpose(1, 2)
        bias = ((1.0 - valid) * -10000.0)[:, None, None, :]
        attended = F.scaled_dot_product_attention(q, k, v, attn_mask=bias).flatten(1)  # [B, E]
        cosine = torch.einsum("bd,bld->bl", F.normalize(target, dim=-1), F.normalize(keys, dim=-1))
        weights = torch.softmax(cosine.masked_fill(valid == 0, float("-inf")), dim=-1)
        pooled = torch.bmm(weights.unsqueeze(1), keys).squeeze(1)
        user = self.user_emb(user_ids).flatten(1)[cand_to_user]
        return torch.sigmoid(self.out(self.dnn(torch.cat([attended, pooled, target, user], dim=-1))))


# ----------------------------------------------------------------------------- inputs


def _feature(name, num_users, num_candidates, gen, dims: Dims):
    """One input tensor by name at `dims`: the zoo's, and the ragged watch history of the YouTube DNN."""
    if name == "watch_ids":  # ragged: 1 to 2L ids per user, flattened (offsets below)
        lengths = torch.randint(1, 2 * dims.history, (num_users,), generator=gen)
        return torch.randint(0, HIST_VOCAB, (int(lengths.sum()),), generator=gen), lengths
    return zoo._feature(name, num_users, num_candidates, gen, dims)


def inputs(model: nn.Module, num_users: int, num_candidates: int, gen: torch.Generator, mapping=None) -> tuple:
    """A request for `model` (its forward's arguments in order; a dict for models that take one) at its dims:
    random features and, unless given, a random `cand_to_user` (sorted where the model's `sorted_mapping` asks)."""
    dims = zoo.dims_of(model)
    if mapping is None:
        mapping = torch.randint(0, num_users, (num_candidates,), generator=gen)
    if getattr(model, "sorted_mapping", False):
        mapping = mapping.sort().values
    code = model.forward.__code__
    names = list(code.co_varnames[1 : code.co_argcount])
    if names == ["features"]:
        features = {n: _feature(n, num_users, num_candidates, gen, dims) for n in ESMM_FEATURES}
        return (features | {"cand_to_user": mapping},)
    values = {}
    for n in names:
        if n == "cand_to_user":
            values[n] = mapping
        elif n == "watch_ids":
            ids, lengths = _feature(n, num_users, num_candidates, gen, dims)
            values[n] = ids
            values["watch_offsets"] = torch.cumsum(lengths, 0) - lengths
        elif n != "watch_offsets":
            values[n] = _feature(n, num_users, num_candidates, gen, dims)
    return tuple(values[n] for n in names)


ESMM_FEATURES = ("user_ids", "user_dense", "cand_ids", "cand_dense")

MODELS = {
    "xdeepfm": XDeepFM,
    "autoint": AutoInt,
    "fibinet": FiBiNET,
    "dlrm": DLRM,
    "esmm": ESMM,
    "can": CAN,
    "decoder": HistoryDecoder,
    "youtube_dnn": YouTubeDNN,
    "cosine_attention": CosineTargetAttention,
}


def build(name: str, seed: int = 0, dims: Dims | None = None) -> nn.Module:
    """The model `name` at `dims` (default small) in eval mode with random weights (BatchNorm statistics
    randomized: `zoo.build`)."""
    return zoo.build(name, seed, models=MODELS, dims=dims)
