"""The body of the decode and verify kernels (tkg.py, whose docstring explains the schedule): one instruction stream
over the (row, position) pairs of a launch."""

from __future__ import annotations

from ..nki_import import nisa, nl
from .operands import matmul_dtype
from .tkg_layout import load_blocks, spread, state_layout

L2_EPS = 1e-6


def decode_steps(mixed_qkv, a, b, A_log, dt_bias, conv_weight, initial_conv, initial_recurrent, operands,
                  heads_per_piece, T, o_shape, conv_shape, state_shape):
    """The body of both kernels, over N = B T rows r = (row r // T, position r % T): the inputs of row r at offset r
    of their flattened [B T, ...] layout, the outputs likewise; a row at position 0 loads its initial states, a later
    one takes the states the row before it computed (on chip: the conv window's last K - 1 columns, the new state
    tiles). T = 1 is the decode kernel."""
    C = mixed_qkv.shape[-1]
    nv = a.shape[-1]
    B = initial_recurrent.shape[0] * T  # rows of the kernel: (row, position) pairs
    _, _, dk, dv = initial_recurrent.shape
    K = conv_weight.shape[1]
    nk = (C - nv * dv) // (2 * dk)
    group = nv // nk
    act = mixed_qkv.dtype
    f32 = nl.float32
    assert 2 * nk * dk + nv * dv == C and nv % nk == 0
    assert dk <= 128 and dv <= 128 and nv <= 128
    qk_ch = 2 * nk * dk
    P = 128
    R, nb, hp = state_layout(nv, dk, dv, heads_per_piece, group)
    assert hp % group == 0 or group % hp == 0, "a piece holds whole GQA groups or part of one"
    u = load_blocks(nk, nb)
    Pl, W = 2 * nk * nb // u, u * R  # load layout: Pl partitions of W consecutive q/k channels
    kp, gp = max(1, hp // group), min(hp, group)  # a piece's key heads, and its value heads per key head
    # v conv on Pv = nv vb partitions (head, block of jl channels)
    vb = max(d for d in range(1, min(dv, 128 // nv) + 1) if dv % d == 0)
    jl, Pv = dv // vb, nv * vb
    NP = nv // hp  # pieces per row's state
    Pn = hp * nb  # partitions of a piece: (head, block of R state rows)
    # TensorE operands (operands.py): by default bf16 for bf16 activations, fp32 for fp32 ones.
    mm = matmul_dtype(operands, act)
    # the state's matmul copies (bf16 operands): tiles of COPY_ROWS rows, alternately on ScalarE and GpSimd; then
    # decay S in two tiles, both on ScalarE after bf16 copies (GpSimd's next step is delta's), else on both engines
    COPY_ENGINES = (nisa.engine.scalar, nisa.engine.gpsimd)
    COPY_ROWS = 1
    DECAY_ENGINES = COPY_ENGINES if mm == f32 else (nisa.engine.scalar, nisa.engine.scalar)

    o_out = nl.ndarray(o_shape, dtype=f32, buffer=nl.shared_hbm)
    conv_out = nl.ndarray(conv_shape, dtype=initial_conv.dtype, buffer=nl.shared_hbm)
    state_out = nl.ndarray(state_shape, dtype=f32, buffer=nl.shared_hbm)

    # ---------------------------------------------------------------- loads: gates, conv inputs, states
    # Initial states: row b starts from initial_conv[b], initial_recurrent[b] (the caller gathers them, zeros for a
    # fresh row): direct transfers, no index to wait for.
    # The gates, loaded once as one contiguous row each (fp32) and repeated on every partition by TensorE (exact).
    gate_rows = []
    for src, n in ((a, B * nv), (b, B * nv), (A_log, nv), (dt_bias, nv)):
        row = nl.ndarray((1, n), dtype=f32, buffer=nl.sbuf)
        nisa.dma_copy(dst=row, src=src.ap(pattern=[[n, 1], [1, n]], offset=0))
        gate_rows.append(row)

    # q/k conv inputs and outputs move in their HBM order, W consecutive channels per partition (one contiguous run
    # of HBM per transfer: Pl partitions [W, row_elems]); TensorE brings them to the state layout (`to_state`).
    def qk_view(src, row_elems, base):
        return src.ap(pattern=[[W * row_elems, Pl], [1, W * row_elems]], offset=base)

    def v_view(src, row_elems, base):
        """The v channels of a [.., C, row_elems] tensor as [Pv partitions (head, block of jl channels),
        jl row_elems]."""
        return src.ap(pattern=[[jl * row_elems, Pv], [1, jl * row_elems]], offset=base + qk_ch * row_elems)

    w_qk = nl.ndarray((Pl, W, K), dtype=conv_weight.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=w_qk, src=qk_view(conv_weight, K, 0))
    w_v = nl.ndarray((Pv, jl, K), dtype=conv_weight.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=w_v, src=v_view(conv_weight, K, 0))
    # the tokens first, then the conv states, then the recurrent states
    tokens = []
    for bi in range(B):
        x_in_qk = nl.ndarray((Pl, W), dtype=act, buffer=nl.sbuf)
        nisa.dma_copy(dst=x_in_qk, src=qk_view(mixed_qkv, 1, bi * C))
        x_in_v = nl.ndarray((Pv, jl), dtype=act, buffer=nl.sbuf)
        nisa.dma_copy(dst=x_in_v, src=v_view(mixed_qkv, 1, bi * C))
        tokens.append((x_in_qk, x_in_v))
    # A later position's conv states are the window of the position before it (set by `causal_conv`'s callers).
    conv_inputs = []
    for bi in range(B):
        st_qk = st_v = None
        if bi % T == 0:
            st_qk = nl.ndarray((Pl, W, K - 1), dtype=act, buffer=nl.sbuf)
            nisa.dma_copy(dst=st_qk, src=qk_view(initial_conv, K - 1, bi // T * C * (K - 1)))
            st_v = nl.ndarray((Pv, jl, K - 1), dtype=act, buffer=nl.sbuf)
            nisa.dma_copy(dst=st_v, src=v_view(initial_conv, K - 1, bi // T * C * (K - 1)))
        conv_inputs.append([st_qk, tokens[bi][0], st_v, tokens[bi][1]])
    # The recurrent states: one transfer per row and piece, R dv fp32 contiguous per partition; a later position's
    # pieces are the tiles the position before it computed (set by `update`).
    states = []
    for bi in range(B):
        row = [None] * NP
        if bi % T == 0:
            for pi in range(NP):
                row[pi] = nl.ndarray((Pn, R, dv), dtype=f32, buffer=nl.sbuf)
                nisa.dma_copy(dst=row[pi], src=initial_recurrent.ap(
                    pattern=[[R * dv, Pn], [dv, R], [1, dv]], offset=(bi // T * nv + pi * hp) * dk * dv))
        states.append(row)

    # ---------------------------------------------------------------- constants
    # head_of[p, h] = 1 if partition p of a piece belongs to its head h (p // nb == h); first_of[p, h] = 1 if p is
    # that head's first partition; same_head = head_of head_of^T (sums over each head's partitions).
    ones = nl.ndarray((P, P), dtype=f32, buffer=nl.sbuf)
    nisa.memset(ones, 1.0)
    ones_row = ones[0:1, 0:P]

    def on_partitions(row):
        """[1, n] -> [P, n]: the row on every partition (one fp32 matmul with a row of ones per 512 columns)."""
        n = row.shape[1]
        out = nl.ndarray((P, n), dtype=f32, buffer=nl.sbuf)
        for c0 in range(0, n, 512):
            c1 = min(n, c0 + 512)
            ps = nl.ndarray((P, c1 - c0), dtype=f32, buffer=nl.psum)
            nisa.nc_matmul(dst=ps, stationary=ones_row, moving=row[:, c0:c1])
            nisa.tensor_copy(dst=out[:, c0:c1], src=ps, engine=nisa.engine.scalar)
        return out

    a_bc, b_bc, alog_bc, dtb_bc = (on_partitions(row) for row in gate_rows)
    a_bc, b_bc = a_bc.reshape((P, B, nv)), b_bc.reshape((P, B, nv))
    head_of = nl.ndarray((Pn, hp), dtype=f32, buffer=nl.sbuf)
    nisa.affine_select(dst=head_of, pattern=[[-nb, hp]], channel_multiplier=1, on_true_tile=ones[0:Pn, 0:hp],
                       on_false_value=0.0, cmp_op=nl.greater_equal)  # p - nb h >= 0
    nisa.affine_select(dst=head_of, pattern=[[nb, hp]], channel_multiplier=-1, offset=nb - 1, on_true_tile=head_of,
                       on_false_value=0.0, cmp_op=nl.greater_equal)  # nb h + nb - 1 - p >= 0
    first_of = nl.ndarray((Pn, hp), dtype=f32, buffer=nl.sbuf)
    nisa.affine_select(dst=first_of, pattern=[[-nb, hp]], channel_multiplier=1, on_true_tile=ones[0:Pn, 0:hp],
                       on_false_value=0.0, cmp_op=nl.equal)  # p == nb h
    heads_ps = nl.ndarray((hp, Pn), dtype=f32, buffer=nl.psum)
    nisa.nc_transpose(dst=heads_ps, data=head_of, engine=nisa.engine.tensor)
    heads_row = nl.ndarray((hp, Pn), dtype=f32, buffer=nl.sbuf)  # head_of^T
    nisa.tensor_copy(dst=heads_row, src=heads_ps, engine=nisa.engine.scalar)
    same_ps = nl.ndarray((Pn, Pn), dtype=f32, buffer=nl.psum)
    nisa.nc_matmul(dst=same_ps, stationary=heads_row, moving=heads_row)
    same_head = nl.ndarray((Pn, Pn), dtype=f32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=same_head, src=same_ps, engine=nisa.engine.scalar)
    ident = nl.shared_identity_matrix(n=P, dtype=f32)
    ident_mm = ident
    if mm != f32:
        ident_mm = nl.ndarray((P, P), dtype=mm, buffer=nl.sbuf)
        nisa.tensor_copy(dst=ident_mm, src=ident, engine=nisa.engine.gpsimd)
    eps_col = nl.ndarray((P, 1), dtype=f32, buffer=nl.sbuf)
    nisa.memset(eps_col, L2_EPS)
    # to_state's stationaries: pick[b][m, (g, i, j)] = 1 if block b of load partition m is block j of key head g of
    # a piece's first load partition (u m + b == nb g + j; i: the value heads of that key head)
    pick = []
    for blk in range(u):
        sel_b = nl.ndarray((kp * nb // u, kp, gp, nb), dtype=act, buffer=nl.sbuf)
        nisa.memset(sel_b, 1.0)
        nisa.affine_select(dst=sel_b, pattern=[[-nb, kp], [0, gp], [-1, nb]], channel_multiplier=u, offset=blk,
                           on_true_tile=sel_b, on_false_value=0.0, cmp_op=nl.equal)
        pick.append(sel_b.reshape((kp * nb // u, Pn)))

    def to_state(dst, src):
        """dst[p, pi, c, g, r] = src[m, g, b R + r] for the load partition m and block b holding row r of partition
        p's block (q: c = 0, k: c = 1; its key head's), for every batch row g of the group: u accumulating selection
        matmuls per piece and q/k, each moving every row of the group (exact; dst PSUM [Pn, NP, 2, G, R], src
        [Pl, G, W])."""
        rows = kp * nb // u
        for blk in range(u):  # one stationary for every piece and q/k
            for pi in range(NP):
                for c in range(2):
                    m0 = (c * nk + pi * hp // group) * nb // u
                    nisa.nc_matmul(dst=dst[:, pi, c], stationary=pick[blk],
                                   moving=src[m0:m0 + rows, :, blk * R:(blk + 1) * R])

    # v layout selectors: block_v[p, blk] = 1 if p = vb h + blk for some head h, head_v[p, h] likewise
    at_bh = nl.ndarray((Pv, vb, nv), dtype=f32, buffer=nl.sbuf)
    nisa.affine_select(dst=at_bh, pattern=[[-1, vb], [-vb, nv]], channel_multiplier=1,
                       on_true_tile=ones[0:Pv, 0:vb * nv].reshape((Pv, vb, nv)), on_false_value=0.0,
                       cmp_op=nl.equal)  # p == vb h + blk
    block_v32 = nl.ndarray((Pv, vb), dtype=f32, buffer=nl.sbuf)
    nisa.tensor_reduce(dst=block_v32, op=nl.add, data=at_bh, axis=2)
    block_v = nl.ndarray((Pv, vb), dtype=act, buffer=nl.sbuf)
    nisa.tensor_copy(dst=block_v, src=block_v32, engine=nisa.engine.gpsimd)
    head_v32 = nl.ndarray((Pv, nv), dtype=f32, buffer=nl.sbuf)
    nisa.tensor_reduce(dst=head_v32, op=nl.add, data=at_bh.permute((0, 2, 1)), axis=2)
    head_v = nl.ndarray((Pv, nv), dtype=act, buffer=nl.sbuf)
    nisa.tensor_copy(dst=head_v, src=head_v32, engine=nisa.engine.gpsimd)

    # ---------------------------------------------------------------- gates of every row and head: [P, B, nv]
    def gates():
        """decay = exp(g), beta, -beta decay ([P, B, nv]) and the decay of each state partition's head
        ([Pn, B, NP]); issued after the first rows' q/k conv (most elementwise steps on GpSimd, short here)."""
        rate = nl.ndarray((P, nv), dtype=f32, buffer=nl.sbuf)  # exp(A_log)
        nisa.activation(dst=rate, op=nl.exp, data=alog_bc)
        sp = nl.ndarray((P, B, nv), dtype=f32, buffer=nl.sbuf)  # softplus(a + dt_bias)
        nisa.tensor_tensor(dst=sp, data1=a_bc, data2=dtb_bc.expand_dim(1).broadcast(1, B), op=nl.add,
                           engine=nisa.engine.gpsimd)
        nisa.activation(dst=sp, op=nl.softplus, data=sp)
        neg_g = nl.ndarray((P, B, nv), dtype=f32, buffer=nl.sbuf)  # -g = exp(A_log) * softplus(...) >= 0
        nisa.tensor_tensor(dst=neg_g, data1=sp, data2=rate.expand_dim(1).broadcast(1, B), op=nl.multiply,
                           engine=nisa.engine.gpsimd)
        decay = nl.ndarray((P, B, nv), dtype=f32, buffer=nl.sbuf)  # exp(g) = exp(-(-g)), exponent <= 0
        nisa.activation(dst=decay, op=nl.exp, data=neg_g, scale=-1.0)
        # beta = sigmoid(b) rounded to the activation dtype, as the unfused model computes it (then used in fp32)
        beta_act = nl.ndarray((P, B, nv), dtype=a.dtype, buffer=nl.sbuf)
        nisa.activation(dst=beta_act, op=nl.sigmoid, data=b_bc)
        beta = nl.ndarray((P, B, nv), dtype=f32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=beta, src=beta_act, engine=nisa.engine.gpsimd)
        neg_beta_decay = nl.ndarray((P, B, nv), dtype=f32, buffer=nl.sbuf)
        nisa.scalar_tensor_tensor(dst=neg_beta_decay, data=beta, op0=nl.multiply, operand0=-1.0, op1=nl.multiply,
                                  operand1=decay)
        # decay of each state partition's head: [Pn, B, NP]
        sel_decay = nl.ndarray((Pn, B, NP, hp), dtype=f32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=sel_decay, data1=decay[0:Pn].reshape((Pn, B, NP, hp)),
                           data2=spread(head_of, (Pn, B, NP, hp), (0, 3)), op=nl.multiply, engine=nisa.engine.gpsimd)
        decay_part = nl.ndarray((Pn, B, NP), dtype=f32, buffer=nl.sbuf)
        nisa.tensor_reduce(dst=decay_part, op=nl.add, data=sel_decay, axis=3)
        return decay, beta, neg_beta_decay, decay_part

    # ---------------------------------------------------------------- per row and piece: the state
    # Per row: the conv, norms and selectors of every piece (`row_inputs`); per row and piece: the state's matmul
    # copies and decay S (`start`), the reduction, delta and o (`finish`), the state update and stores (`update`); the
    # next piece's `start` is issued between this piece's `finish` and `update`, so that each engine's in-order
    # stream has it queued while this piece's chain waits, without delaying this piece's short steps.
    # The q/k conv runs row by row in the load layout; its selection into the state layout runs once for a group of
    # G rows (every row at batch <= 16: the selection matmuls cost their 64-cycle minimum up to 64 moving columns, 4x
    # that with fp32 activations, so one matmul per group instead of one per row).
    G = max(1, min(B, 2048 // (4 * NP * 2 * R), 512 // R))  # one PSUM bank, at most 512 moving columns
    qk_rows = {}

    def conv_group(g):
        members = list(range(g * G, min(B, (g + 1) * G)))
        x_rows = nl.ndarray((Pl, len(members), W), dtype=act, buffer=nl.sbuf)
        wins = [conv_qk(bi, x_rows[:, i]) for i, bi in enumerate(members)]
        x_ps = nl.ndarray((Pn, NP, 2, len(members), R), dtype=f32, buffer=nl.psum)  # q, k, state layout (exact)
        to_state(x_ps, x_rows)
        for i, bi in enumerate(members):
            qk_rows[bi] = (x_ps[:, :, :, i, :], wins[i])

    def causal_conv(bi, P, width, st, x_in, w, out):
        """Row bi's depthwise causal conv and SiLU over P partitions x width channels: the window [state | x]
        (returned: its last K - 1 columns are the new conv state) times the weights, summed, into `out`."""
        win = nl.ndarray((P, width, K), dtype=act, buffer=nl.sbuf)
        nisa.tensor_copy(dst=win[:, :, 0:K - 1], src=st, engine=nisa.engine.gpsimd)
        nisa.tensor_copy(dst=win[:, :, K - 1], src=x_in, engine=nisa.engine.gpsimd)
        prod = nl.ndarray((P, width, K), dtype=f32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=prod, data1=win, data2=w, op=nl.multiply)
        acc = nl.ndarray((P, width), dtype=f32, buffer=nl.sbuf)
        nisa.tensor_reduce(dst=acc, op=nl.add, data=prod, axis=2)
        nisa.activation(dst=out, op=nl.silu, data=acc)  # rounded as the unfused model rounds it
        return win

    def conv_qk(bi, x_in_order):
        st_qk, x_in_qk, _, _ = conv_inputs[bi]
        win = causal_conv(bi, Pl, W, st_qk, x_in_qk, w_qk, x_in_order)  # load layout
        if (bi + 1) % T:  # the next position's conv state: this window's last K - 1 columns
            conv_inputs[bi + 1][0] = win[:, :, 1:K]
        return win

    def row_inputs(bi, after_norms=None):
        # -------------------------------------------------------- the row's conv, SiLU, norms (every piece at once)
        if bi not in qk_rows:
            conv_group(bi // G)
        x_ps, win_qk = qk_rows.pop(bi)
        _, _, st_v, x_in_v = conv_inputs[bi]
        x_qk = nl.ndarray((Pn, NP, 2, R), dtype=act, buffer=nl.sbuf)
        nisa.tensor_copy(dst=x_qk, src=x_ps, engine=nisa.engine.scalar)
        # per partition: sums over its R rows of q^2, k^2 and q k; per head: the same_head matmul (fp32, exact)
        sq = nl.ndarray((Pn, NP, 2, R), dtype=f32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=sq, data1=x_qk, data2=x_qk, op=nl.multiply, engine=nisa.engine.gpsimd)
        sums = nl.ndarray((Pn, NP, 3), dtype=f32, buffer=nl.sbuf)
        nisa.tensor_reduce(dst=sums[:, :, 0:2], op=nl.add, data=sq, axis=3)
        qk_prod = nl.ndarray((Pn, NP, R), dtype=f32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=qk_prod, data1=x_qk[:, :, 0], data2=x_qk[:, :, 1], op=nl.multiply,
                           engine=nisa.engine.gpsimd)
        nisa.tensor_reduce(dst=sums[:, :, 2], op=nl.add, data=qk_prod, axis=2)
        totals_ps = nl.ndarray((Pn, NP, 3), dtype=f32, buffer=nl.psum)
        nisa.nc_matmul(dst=totals_ps, stationary=same_head, moving=sums)
        # rsqrt(|q|^2 + eps), rsqrt(|k|^2 + eps) straight from PSUM (the q scale dk^-0.5 is applied where q is used:
        # in sel and in k . q, which saves a step on the way to the first state store)
        inv = nl.ndarray((Pn, NP, 2), dtype=f32, buffer=nl.sbuf)
        nisa.activation(dst=inv, op=nl.rsqrt, data=totals_ps[:, :, 0:2], bias=eps_col[0:Pn])
        qk_dot = nl.ndarray((Pn, NP), dtype=f32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=qk_dot, src=totals_ps[:, :, 2], engine=nisa.engine.scalar)
        # v: needed last (by delta); its conv fills VectorE while the sums go through TensorE and ScalarE, issued after
        # rsqrt so that ScalarE runs rsqrt before the conv's SiLU. v^T [dv, nv] (exact: v in its own dtype times 0/1):
        # the stationary spreads each partition's jl values to their block's position (v_at[p, blk, c] = v[p, c] if
        # blk is p's block), the moving picks p's head
        x_v = nl.ndarray((Pv, jl), dtype=act, buffer=nl.sbuf)
        win_v = causal_conv(bi, Pv, jl, st_v, x_in_v, w_v, x_v)
        if (bi + 1) % T:
            conv_inputs[bi + 1][2] = win_v[:, :, 1:K]
        v_at = nl.ndarray((Pv, vb, jl), dtype=act, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=v_at, data1=spread(x_v, (Pv, vb, jl), (0, 2)),
                           data2=spread(block_v, (Pv, vb, jl), (0, 1)),
                           op=nl.multiply, engine=nisa.engine.gpsimd)
        qk_n = nl.ndarray((Pn, NP, 2, R), dtype=f32, buffer=nl.sbuf)  # normalised q (0, without dk^-0.5), k (1)
        nisa.tensor_tensor(dst=qk_n, data1=x_qk, data2=spread(inv, (Pn, NP, 2, R), (0, 1, 2)), op=nl.multiply)
        if after_norms is not None:
            after_norms()
        # the reduction's moving operands: sel[p, piece, r, (k|q), h] = (k|q)[p, r] if p is in head h, else 0
        sel = nl.ndarray((Pn, NP, R, 2, hp), dtype=mm, buffer=nl.sbuf)
        kq_order = qk_n.permute((0, 1, 3, 2))  # [Pn, NP, R, (q|k)]
        for c, src, scale in ((0, 1, 1.0), (1, 0, float(dk) ** -0.5)):  # k first, then q (times dk^-0.5)
            nisa.scalar_tensor_tensor(dst=sel[:, :, :, c, :],
                                      data=spread(kq_order[:, :, :, src], (Pn, NP, R, hp), (0, 1, 2)),
                                      op0=nl.multiply, operand0=scale, op1=nl.multiply,
                                      operand1=spread(head_of, (Pn, NP, R, hp), (0, 3)))
        kq = nl.ndarray((Pn, NP), dtype=f32, buffer=nl.sbuf)  # normalised k . q of the partition's head
        nisa.scalar_tensor_tensor(dst=kq, data=inv[:, :, 0], op0=nl.multiply, operand0=float(dk) ** -0.5,
                                  op1=nl.multiply, operand1=inv[:, :, 1])
        nisa.tensor_tensor(dst=kq, data1=kq, data2=qk_dot, op=nl.multiply, engine=nisa.engine.gpsimd)
        # k . q of each head along the free axis, on the dv partitions: ones^T (first_of * kq) -> [dv, NP, hp]
        kq_first = nl.ndarray((Pn, NP, hp), dtype=f32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=kq_first, data1=spread(first_of, (Pn, NP, hp), (0, 2)),
                           data2=spread(kq, (Pn, NP, hp), (0, 1)), op=nl.multiply, engine=nisa.engine.gpsimd)
        v_ps = nl.ndarray((dv, nv), dtype=f32, buffer=nl.psum)
        nisa.nc_matmul(dst=v_ps, stationary=v_at, moving=head_v)
        store_conv_state(bi, win_qk, win_v)

        def kq_columns():
            """k . q as columns [dv, nv], which only o needs: an fp32 matmul issued after the row's first state
            matmuls and delta's steps, which TensorE's in-order stream would otherwise hold behind it."""
            kq_ps = nl.ndarray((dv, NP, hp), dtype=f32, buffer=nl.psum)
            nisa.nc_matmul(dst=kq_ps, stationary=ones[0:Pn, 0:dv], moving=kq_first)
            kq_cols = nl.ndarray((dv, nv), dtype=f32, buffer=nl.sbuf)
            nisa.tensor_copy(dst=kq_cols, src=kq_ps.reshape((dv, nv)), engine=nisa.engine.scalar)
            return kq_cols

        return dict(sel=sel, qk_n=qk_n, v_ps=v_ps, kq_columns=kq_columns)

    def start(bi, pi, with_decay=True):
        """The piece's matmul copies of the state (bf16 operands: tiles of COPY_ROWS rows, alternately on ScalarE and
        GpSimd, so that the matmuls start on the first tiles while the others are copied) and decay S."""
        S = states[bi][pi]
        S_mm = [(0, S)]  # (first row, tile) in the order the matmuls take them
        if mm != f32:
            S_mm = []
            for i, r0 in enumerate(range(0, R, COPY_ROWS)):
                r1 = min(R, r0 + COPY_ROWS)
                tile = nl.ndarray((Pn, r1 - r0, dv), dtype=mm, buffer=nl.sbuf)
                nisa.tensor_copy(dst=tile, src=S[:, r0:r1, :], engine=COPY_ENGINES[i % 2])
                S_mm.append((r0, tile))
        started = [S_mm, None]
        if with_decay:
            decay_state(bi, pi, started)
        return started

    def decay_state(bi, pi, started, engines=DECAY_ENGINES):
        """decay S, its rows split evenly over `engines` (one tile each: the update only reads them)."""
        parts, n = [], len(engines)
        for i, engine in enumerate(engines):
            r0, r1 = i * R // n, (i + 1) * R // n
            decayed = nl.ndarray((Pn, r1 - r0, dv), dtype=f32, buffer=nl.sbuf)
            nisa.tensor_scalar(dst=decayed, data=states[bi][pi][:, r0:r1, :], op0=nl.multiply,
                               operand0=decay_part[:, bi, pi:pi + 1], engine=engine)
            parts += [(decayed, r - r0) for r in range(r0, r1)]
        started[1] = parts  # row r of decay S: parts[r] = (tile, row in it)

    def finish(bi, pi, started, row):
        h0 = pi * hp
        gate = slice(h0, h0 + hp)
        S_mm, decayed = started
        sel = row['sel']
        # mem = S^T k, Sq = S^T q: [dv, (k|q), hp]; R accumulating matmuls, each contracting the partitions
        # (heads x blocks) for one state row of every block
        msq_ps = nl.ndarray((dv, 2, hp), dtype=f32, buffer=nl.psum)
        for r0, tile in S_mm:
            for r in range(r0, r0 + tile.shape[1]):
                nisa.nc_matmul(dst=msq_ps, stationary=tile[:, r - r0, :], moving=sel[:, pi, r])
        if 'bv' not in row:  # beta v: [dv, nv]
            row['bv'] = nl.ndarray((dv, nv), dtype=f32, buffer=nl.sbuf)
            nisa.tensor_tensor(dst=row['bv'], data1=row['v_ps'], data2=beta[0:dv, bi, :], op=nl.multiply)
        bv = row['bv']
        # delta = beta v - beta decay mem: [dv, hp]; -beta decay mem on VectorE straight from PSUM, then the sum
        # written repeated nb times (GpSimd) as the stationary that spreads each head's delta along its partitions:
        # (delta repeated nb times)^T I -> [Pn, dv] (the state update's delta rows)
        bdm = nl.ndarray((dv, hp), dtype=f32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=bdm, data1=msq_ps[:, 0, :], data2=neg_beta_decay[0:dv, bi, gate], op=nl.multiply)
        delta_x = nl.ndarray((dv, hp, nb), dtype=mm, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=delta_x, data1=spread(bdm, (dv, hp, nb), (0, 1)),
                           data2=spread(bv[:, gate], (dv, hp, nb), (0, 1)), op=nl.add, engine=nisa.engine.gpsimd)
        rows_ps = nl.ndarray((Pn, dv), dtype=f32, buffer=nl.psum)
        nisa.nc_matmul(dst=rows_ps, stationary=delta_x, moving=ident_mm[0:dv, 0:dv])

        # o = decay Sq + (k . q) delta: [dv, hp] (GpSimd: short instructions)
        if 'kq_cols' not in row:
            row['kq_cols'] = row.pop('kq_columns')()
        kq_cols = row['kq_cols']
        msq = nl.ndarray((dv, 2, hp), dtype=f32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=msq, src=msq_ps, engine=nisa.engine.scalar)
        delta = nl.ndarray((dv, hp), dtype=f32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=delta, data1=bdm, data2=bv[:, gate], op=nl.add, engine=nisa.engine.gpsimd)

        o_cols = nl.ndarray((dv, hp), dtype=f32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=o_cols, data1=msq[:, 1, :], data2=decay[0:dv, bi, gate], op=nl.multiply,
                           engine=nisa.engine.gpsimd)
        kqd = nl.ndarray((dv, hp), dtype=f32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=kqd, data1=kq_cols[:, gate], data2=delta, op=nl.multiply,
                           engine=nisa.engine.gpsimd)
        nisa.tensor_tensor(dst=o_cols, data1=o_cols, data2=kqd, op=nl.add, engine=nisa.engine.gpsimd)

        return o_cols, rows_ps

    def update(bi, pi, started, row, finished):
        h0 = pi * hp
        S_mm, decayed = started
        o_cols, rows_ps = finished
        qk_n = row['qk_n']
        # S = decay S + k delta^T, one state row of every block per instruction (VectorE)
        new_state = nl.ndarray((Pn, R, dv), dtype=f32, buffer=nl.sbuf)
        k_n = qk_n[:, pi, 1, :]
        for r in range(R):
            nisa.scalar_tensor_tensor(dst=new_state[:, r, :], data=rows_ps, op0=nl.multiply,
                                      operand0=k_n[:, r:r + 1], op1=nl.add, operand1=decayed[r][0][:, decayed[r][1], :])
        nisa.dma_copy(dst=state_out.ap(pattern=[[R * dv, Pn], [dv, R], [1, dv]], offset=(bi * nv + h0) * dk * dv),
                      src=new_state)
        states[bi][pi] = None
        if (bi + 1) % T:  # the next position starts from this state (on chip; the store above is its copy out)
            states[bi + 1][pi] = new_state

        def store_o():
            """o to rows and out: issued after the next piece's state matmuls, which TensorE's in-order stream would
            otherwise hold behind this transpose (o waits for k . q, the last of the piece's steps)."""
            o_rows = nl.ndarray((hp, dv), dtype=f32, buffer=nl.psum)
            nisa.nc_transpose(dst=o_rows, data=o_cols, engine=nisa.engine.tensor)
            o_sb = nl.ndarray((hp, dv), dtype=f32, buffer=nl.sbuf)
            nisa.tensor_copy(dst=o_sb, src=o_rows, engine=nisa.engine.scalar)
            nisa.dma_copy(dst=o_out.ap(pattern=[[dv, hp], [1, dv]], offset=(bi * nv + h0) * dv), src=o_sb)

        return store_o

    def store_conv_state(bi, win_qk, win_v):
        # The new conv states: the last K - 1 inputs.
        new_qk = nl.ndarray((Pl, W, K - 1), dtype=act, buffer=nl.sbuf)
        nisa.tensor_copy(dst=new_qk, src=win_qk[:, :, 1:K], engine=nisa.engine.gpsimd)
        new_v = nl.ndarray((Pv, jl, K - 1), dtype=act, buffer=nl.sbuf)
        nisa.tensor_copy(dst=new_v, src=win_v[:, :, 1:K], engine=nisa.engine.gpsimd)

        # the conv states out (queued behind the state loads)
        nisa.dma_copy(dst=qk_view(conv_out, K - 1, bi * C * (K - 1)), src=new_qk)
        nisa.dma_copy(dst=v_view(conv_out, K - 1, bi * C * (K - 1)), src=new_v)

    units = [(bi, pi) for bi in range(B) for pi in range(NP)]
    started = {}

    def after_first_norms():
        started[units[0]] = start(*units[0], with_decay=False)

    conv_group(0)  # the first rows' q/k conv, then the gates (which wait for nothing but their rows)
    decay, beta, neg_beta_decay, decay_part = gates()
    rows = {0: row_inputs(0, after_norms=after_first_norms)}
    # the first piece's decay S, after the row's norm steps in ScalarE's stream (its copies were issued among them)
    decay_state(*units[0], started[units[0]])
    store_o = None
    for i, (bi, pi) in enumerate(units):
        unit = started.pop((bi, pi))
        finished = finish(bi, pi, unit, rows[bi])
        if store_o is not None:  # the previous piece's o
            store_o()
        waiting = None  # a next piece whose state this piece's update computes (one piece per row, T > 1)
        if i + 1 < len(units):
            if units[i + 1][1] == 0:
                rows[units[i + 1][0]] = row_inputs(units[i + 1][0])
            if states[units[i + 1][0]][units[i + 1][1]] is None:
                waiting = units[i + 1]
            else:
                started[units[i + 1]] = start(*units[i + 1])
        store_o = update(bi, pi, unit, rows[bi], finished)
        if waiting is not None:
            started[waiting] = start(*waiting)
        if pi == NP - 1:
            rows.pop(bi)
    store_o()
    return o_out, conv_out, state_out
