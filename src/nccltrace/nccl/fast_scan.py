"""Compiled fast path of the NCCL log reader.

Call and TUNING lines are nearly all of a large log. :func:`scan_block` decodes those that are
*certainly* clean single records into a column-major record matrix and hands every other line
back to the Python reader, so a line the kernel takes is only ever a speed-up, never a different
result; :func:`apply_state` replays the reader's order-dependent rules (duplicate calls, TUNING
attachment) over a block's records, its state carried in :class:`FastState`. Design:
``docs/nccl-log-parsing.md``, Module notes.
"""

from __future__ import annotations

import numpy as np
from numba import njit
from numba import types as nt

from nccltrace.nccl.enums import ALGORITHMS, ALL_OPS, PROTOCOLS

OPS: tuple[str, ...] = tuple(ALL_OPS)
OP_ALLGATHER = OPS.index("AllGather")
OP_REDUCESCATTER = OPS.index("ReduceScatter")
OP_SEND = OPS.index("Send")
OP_RECV = OPS.index("Recv")
# Ops whose nccl-tests message size is bytes x nranks (see enums.bus_message_bytes).
FULL_BUFFER_OPS: tuple[str, ...] = ("AllGather", "ReduceScatter", "AlltoAll", "Gather", "Scatter")

# Record kinds produced by scan_block.
KIND_CALL = 0
KIND_TUNE_NAMED = 1  # "%s: %ld Bytes -> Algo %s proto %s channel{Lo..Hi}={%d..%d}" (>= 2.24)
KIND_TUNE_OP_NUMERIC = 2  # "%s: %ld Bytes -> Algo %d proto %d time %f" (2.23)
KIND_TUNE_NUMERIC = 3  # "%ld Bytes -> Algo %d proto %d time %f" (2.20 - 2.22)
# A call no TUNING line can describe (single-rank comm, or this process is not rank 0 of the comm):
# set by the Python side just for apply_state, so it is not remembered for attachment.
KIND_CALL_NOTUNE = 4
TUNING_FORMATS = ("op_bytes_named", "op_bytes_numeric", "bytes_numeric")  # index = kind - 1

# Wall-clock kinds (timestamp found in the prefix).
WALL_NONE = 0
WALL_LOCAL = 1  # "[YYYY-MM-DD HH:MM:SS(.f)] "
WALL_EPOCH = 2  # "<epoch seconds>.<fraction> "

N_DATATYPES = 12  # ncclDataType_t values the kernel accepts (0 .. 11)
TUNE_WINDOW = 256  # recent calls kept per pid for TUNING attachment (= _FileParser.TUNE_WINDOW)

# Record matrix (int64, one row per record). Columns 0..19 are also the layout of the calls and
# TUNING lines parsed on the Python side that apply_state replays with the fast records; pointers are
# the bits of the uint64 as int64. KIND: KIND_* for fast records; 0 call, 1 TUNING, 2 TUNING with
# 2.20-2.23 full-buffer bytes for Python-side ones (so kind >= 2 means full buffer for both).
# HID/PID are host/pid ids of the reader, OP an index in OPS (or of ops seen by the reader) or -1
# for TUNING lines without op; OPC is the opCount, BYTES count x type size for calls and the printed
# bytes for TUNING lines. The fast records also have: LS/IP line start and position of "NCCL INFO ",
# CHANGE (prefix differs from the previous record's, timestamp aside), WK wall-clock kind (WALL_*),
# and the TUNING fields.
(R_LINE, R_KIND, R_HID, R_PID, R_COMM, R_OP, R_OPC, R_SEND, R_RECV, R_COUNT, R_DTYPE, R_REDOP, R_ROOT, R_NRANKS,
 R_STREAM, R_TID, R_TIDNULL, R_WALL, R_WALLNULL, R_BYTES) = range(20)
S_NFIELDS = 20
R_LS, R_IP, R_CHANGE, R_WK, R_ALGO, R_PROTO, R_LO, R_HI = range(20, 28)
R_NFIELDS = 28


def _name_table(names) -> tuple[np.ndarray, np.ndarray]:
    width = max(len(n) for n in names)
    table = np.zeros((len(names), width), np.uint8)
    lens = np.zeros(len(names), np.int64)
    for i, name in enumerate(names):
        b = name.encode("ascii")
        table[i, : len(b)] = np.frombuffer(b, np.uint8)
        lens[i] = len(b)
    return table, lens


_OP_TABLE, _OP_LENS = _name_table(OPS)
_ALGO_TABLE, _ALGO_LENS = _name_table(ALGORITHMS)
_PROTO_TABLE, _PROTO_LENS = _name_table(PROTOCOLS)

# Literal separators, one row each (index constants below).
_LITERALS = (": opCount ", " sendbuff ", " recvbuff ", " count ", " datatype ", " op ", " root ", " comm ",
             " [nranks=", "] stream ", "(nil)", " Bytes -> Algo ", " proto ", " time ", " channel{Lo..Hi}={", "..")
_LIT, _LIT_LENS = _name_table(_LITERALS)
L_NIL, L_BYTES_ALGO, L_PROTO, L_TIME, L_CHANNEL, L_DOTDOT = range(10, 16)
# The call message after the op name: literal i then field i of this kind (max digits).
F_HEX, F_PTR, F_SINT, F_UINT = range(4)
_CALL_KIND = np.array([F_HEX, F_PTR, F_PTR, F_SINT, F_SINT, F_SINT, F_SINT, F_PTR, F_UINT, F_PTR], np.int64)
_CALL_MAXD = np.array([15, 0, 0, 18, 4, 9, 9, 0, 9, 0], np.int64)
_CALL_COL = np.array([R_OPC, R_SEND, R_RECV, R_COUNT, R_DTYPE, R_REDOP, R_ROOT, R_COMM, R_NRANKS, R_STREAM], np.int64)

# Byte classes as the bytes regexes of the reader see them.
CC_DIGIT, CC_WORD, CC_HOST, CC_SPACE = 1, 2, 4, 8


def _classes() -> tuple[np.ndarray, np.ndarray]:
    cc = np.zeros(256, np.uint8)
    hexv = np.full(256, -1, np.int64)
    for c in range(256):
        ch = chr(c)
        if "0" <= ch <= "9":
            cc[c] |= CC_DIGIT
        if ch.isascii() and (ch.isalnum() or ch == "_"):
            cc[c] |= CC_WORD | CC_HOST
        if ch in ".-":
            cc[c] |= CC_HOST
        if ch in " \t\n\r\x0b\x0c":  # bytes-regex \s
            cc[c] |= CC_SPACE
        if ch in "0123456789abcdefABCDEF":
            hexv[c] = int(ch, 16)
    return cc, hexv


_CC, _HEXV = _classes()
_TS_DIGITS = np.array([1, 2, 3, 4, 6, 7, 9, 10, 12, 13, 15, 16, 18, 19], np.int64)  # in "[YYYY-MM-DD HH:MM:SS"
_POW10 = np.array([10.0**k for k in range(23)], np.float64)
_INT64_MAX = np.int64(9223372036854775807)

# Explicit signatures: one compilation per function (literal arguments would otherwise each get
# their own), done once and cached on disk.
_I = nt.int64
_B = nt.boolean
_BUF = nt.Array(nt.uint8, 1, "C", readonly=True)
_M = nt.Array(_I, 2, "C")
_R = nt.Array(_I, 2, "F")  # records: column-major, so that each field is a contiguous array
_A = nt.Array(_I, 2, "A")


def _arr(dtype, ndim: int = 1):
    return nt.Array(dtype, ndim, "C")


# --- byte helpers -----------------------------------------------------------------------
@njit((_BUF, _I, _I, _I), cache=True)
def _lit(buf, p, n, k):
    """Position after literal ``k`` if it is at ``p``, else -1."""
    m = _LIT_LENS[k]
    if p < 0 or p + m > n:
        return -1
    for i in range(m):
        if buf[p + i] != _LIT[k, i]:
            return -1
    return p + m


@njit((_BUF, _I, _I, _I, _B), cache=True)
def _int(buf, p, n, maxdigits, signed):
    """``\\d+`` (``-?\\d+`` if signed) with at most ``maxdigits`` digits -> (value, end) or (0, -1)."""
    if p < 0:
        return np.int64(0), -1
    neg = False
    if signed and p < n and buf[p] == 45:
        neg = True
        p += 1
    v = np.int64(0)
    q = p
    while q < n and _CC[buf[q]] & CC_DIGIT:
        if q - p >= maxdigits:
            return np.int64(0), -1
        v = v * 10 + (np.int64(buf[q]) - 48)
        q += 1
    if q == p:
        return np.int64(0), -1
    return (-v if neg else v), q


@njit((_BUF, _I, _I), cache=True)
def _ptr(buf, p, n):
    """A ``%p`` token the reader decodes unambiguously, ``(nil)`` or ``0x`` + 1..16 hex digits, as
    (int64 with the bits of the uint64, end) or (0, -1)."""
    q = _lit(buf, p, n, L_NIL)
    if q >= 0:
        return np.int64(0), q
    if p < 0 or p + 2 >= n or buf[p] != 48 or buf[p + 1] != 120:
        return np.int64(0), -1
    v = np.uint64(0)
    q = p + 2
    while q < n and _HEXV[buf[q]] >= 0:
        if q - p - 2 >= 16:
            return np.int64(0), -1
        v = v * np.uint64(16) + np.uint64(_HEXV[buf[q]])
        q += 1
    if q == p + 2:
        return np.int64(0), -1
    return np.int64(v), q


@njit((_BUF, _I, _I, _I), cache=True)
def _lookup(buf, a, b, which):
    """Index of ``buf[a:b]`` in a name table (0 ops, 1 algorithms, 2 protocols), or -1."""
    if which == 0:
        table, lens = _OP_TABLE, _OP_LENS
    elif which == 1:
        table, lens = _ALGO_TABLE, _ALGO_LENS
    else:
        table, lens = _PROTO_TABLE, _PROTO_LENS
    m = b - a
    for i in range(lens.shape[0]):
        if lens[i] != m:
            continue
        ok = True
        for k in range(m):
            if buf[a + k] != table[i, k]:
                ok = False
                break
        if ok:
            return i
    return -1


@njit((_BUF, _I, _I), cache=True)
def _word_end(buf, p, n):
    while p < n and _CC[buf[p]] & CC_WORD:
        p += 1
    return p


@njit((_BUF, _I, _I), cache=True)
def _line_end(buf, p, n):
    """``\\s*$``: position of the newline (or n) if only whitespace is left on the line, else -1."""
    while p < n and buf[p] != 10:
        if not _CC[buf[p]] & CC_SPACE:
            return -1
        p += 1
    return p


@njit((_I, _I, _I), cache=True)
def days_from_civil(y, m, d):
    """Days since 1970-01-01 of a proleptic Gregorian date (= date.toordinal() - 719163)."""
    y = y - (1 if m <= 2 else 0)
    era = (y if y >= 0 else y - 399) // 400
    yoe = y - era * 400
    mp = m - 3 if m > 2 else m + 9
    doy = (153 * mp + 2) // 5 + d - 1
    doe = yoe * 365 + yoe // 4 - yoe // 100 + doy
    return era * 146097 + doe - 719468


@njit((_BUF, _I, _I), cache=True)
def _bracket_ts(buf, b, lim):
    """``\\[YYYY-MM-DD[ T]HH:MM:SS(\\.\\d{1,9})?\\] `` at ``b`` (the reader's _TS_BRACKET).

    Returns (status, end, wall_ns): status 0 = no match, 1 = match, 2 = match the kernel does
    not decode (a month the reader rejects, or a date whose nanoseconds leave int64).
    """
    z = np.int64(0)
    if b + 22 > lim or buf[b] != 91:
        return 0, -1, z
    for i in range(_TS_DIGITS.shape[0]):
        if not _CC[buf[b + _TS_DIGITS[i]]] & CC_DIGIT:
            return 0, -1, z
    if buf[b + 5] != 45 or buf[b + 8] != 45 or (buf[b + 11] != 32 and buf[b + 11] != 84) or buf[b + 14] != 58 \
            or buf[b + 17] != 58:
        return 0, -1, z
    q = b + 20
    ns = np.int64(0)
    if buf[q] == 46:
        r = q + 1
        while r < lim and _CC[buf[r]] & CC_DIGIT and r - q - 1 < 10:
            ns = ns * 10 + (np.int64(buf[r]) - 48)
            r += 1
        nd = r - q - 1
        if nd < 1 or nd > 9 or r + 1 >= lim or buf[r] != 93 or buf[r + 1] != 32:
            return 0, -1, z
        for _ in range(9 - nd):
            ns *= 10
        end = r + 2
    elif q + 1 < lim and buf[q] == 93 and buf[q + 1] == 32:
        end = q + 2
    else:
        return 0, -1, z
    v = np.int64(0)  # YYYYMMDDHHMMSS
    for i in range(_TS_DIGITS.shape[0]):
        v = v * 10 + (np.int64(buf[b + _TS_DIGITS[i]]) - 48)
    year, month, day = v // 10**10, v // 10**8 % 100, v // 10**6 % 100
    if month < 1 or month > 12 or year < 1700 or year > 2261:
        return 2, end, z
    days = days_from_civil(year, month, 1) + day - 1
    secs = ((days * 24 + v // 10**4 % 100) * 60 + v // 100 % 100) * 60 + v % 100
    return 1, end, secs * 1_000_000_000 + ns


@njit((_BUF, _I, _I), cache=True)
def _epoch_at(buf, q, lim):
    """``(\\d{9,11})\\.(\\d{1,9}) `` at digit position ``q`` -> (status, run end, end, wall_ns);
    ``run end`` = end of the digit run at ``q`` (where a search resumes)."""
    r = q
    secs = np.int64(0)
    while r < lim and _CC[buf[r]] & CC_DIGIT:
        if r - q < 12:
            secs = secs * 10 + (np.int64(buf[r]) - 48)
        r += 1
    nd = r - q
    if nd >= 9 and nd <= 11 and r < lim and buf[r] == 46:
        s = r + 1
        ns = np.int64(0)
        while s < lim and _CC[buf[s]] & CC_DIGIT and s - r - 1 < 10:
            ns = ns * 10 + (np.int64(buf[s]) - 48)
            s += 1
        k = s - r - 1
        if k >= 1 and k <= 9 and s < lim and buf[s] == 32:
            for _ in range(9 - k):
                ns *= 10
            if secs > 9223372035:
                return 2, r, s + 1, np.int64(0)
            return 1, r, s + 1, secs * 1_000_000_000 + ns
    return 0, r, -1, np.int64(0)


@njit((_BUF, _I, _I), cache=True)
def _prefix(buf, ls, ip):
    """Check the text before the level token at ``ip``: ``host:pid:tid [dev] `` right before it (the
    reader's _PREFIX_TAIL, with pid/tid <= 18 and dev <= 9 digits), then find the timestamp the
    reader decodes (first _TS_BRACKET match, else first _TS_EPOCH match).

    Returns (ok, wall kind, wall_ns, timestamp start, timestamp end).
    """
    z = np.int64(0)
    q = ip - 1
    if q - 1 < ls or buf[q] != 32 or buf[q - 1] != 93:
        return False, WALL_NONE, z, ls, ls
    q -= 2
    d_end = q
    while q >= ls and _CC[buf[q]] & CC_DIGIT:
        q -= 1
    if d_end - q < 1 or d_end - q > 9:
        return False, WALL_NONE, z, ls, ls
    if q >= ls and buf[q] == 45:
        q -= 1
    if q - 1 < ls or buf[q] != 91 or buf[q - 1] != 32:
        return False, WALL_NONE, z, ls, ls
    q -= 2
    for _ in range(2):  # tid, then pid: 1..18 digits after a ':'
        t_end = q
        while q >= ls and _CC[buf[q]] & CC_DIGIT:
            q -= 1
        if t_end - q < 1 or t_end - q > 18 or q < ls or buf[q] != 58:
            return False, WALL_NONE, z, ls, ls
        q -= 1
    h_end = q
    while q >= ls and _CC[buf[q]] & CC_HOST:
        q -= 1
    if h_end == q:
        return False, WALL_NONE, z, ls, ls
    host_start = q + 1
    # No timestamp match can overlap "host:pid:tid [dev] " (no '[' + date, no whitespace + digits
    # + '.' in it), so both searches stop at the host.
    for b in range(ls, host_start):
        if buf[b] == 91:
            status, tend, wall = _bracket_ts(buf, b, host_start)
            if status == 1:
                return True, WALL_LOCAL, wall, b, tend
            if status == 2:
                return False, WALL_NONE, z, ls, ls
    q = ls
    while q < host_start:
        if _CC[buf[q]] & CC_DIGIT and (q == ls or _CC[buf[q - 1]] & CC_SPACE):
            status, r, tend, wall = _epoch_at(buf, q, host_start)
            if status == 1:
                return True, WALL_EPOCH, wall, q, tend
            if status == 2:
                return False, WALL_NONE, z, ls, ls
            q = r
        else:
            q += 1
    return True, WALL_NONE, z, ls, ls


@njit((_BUF, _I, _I, _I), cache=True)
def _same(buf, a, b, m):
    for k in range(m):
        if buf[a + k] != buf[b + k]:
            return False
    return True


@njit((_BUF, _I, _I), cache=True)
def _level(buf, p, n):
    """1 if "NCCL INFO " is at p, 2 if "NCCL WARN ", else 0."""
    if p + 10 > n or buf[p] != 78 or buf[p + 1] != 67 or buf[p + 2] != 67 or buf[p + 3] != 76 \
            or buf[p + 4] != 32 or buf[p + 9] != 32:
        return 0
    if buf[p + 5] == 73 and buf[p + 6] == 78 and buf[p + 7] == 70 and buf[p + 8] == 79:
        return 1
    if buf[p + 5] == 87 and buf[p + 6] == 65 and buf[p + 7] == 82 and buf[p + 8] == 78:
        return 2
    return 0


@njit((_BUF, _I, _I, _I, _R, _arr(nt.float64)), cache=True)
def _message(buf, m, n, i, R, T):
    """Decode the message at ``m`` (after "NCCL INFO ") into row ``i`` of R (and T: TUNING time) if it
    is a call or TUNING line the kernel decodes exactly as the reader. Returns (kind or -1, line end)."""
    t = _word_end(buf, m, n)
    if t == m:
        return -1, -1
    op = -1
    nbytes = np.int64(0)
    if _CC[buf[m]] & CC_DIGIT and t < n and buf[t] == 32:
        # "%ld Bytes -> Algo %d proto %d time %f" (op not printed)
        nbytes, q = _int(buf, m, n, 18, False)
        if q != t:
            return -1, -1
        kind = KIND_TUNE_NUMERIC
    else:
        op = _lookup(buf, m, t, 0)
        if op < 0:
            return -1, -1
        if t + 2 < n and buf[t] == 58 and buf[t + 1] == 32 and _CC[buf[t + 2]] & CC_DIGIT:
            nbytes, q = _int(buf, t + 2, n, 18, False)
            if q < 0:
                return -1, -1
            kind = KIND_TUNE_NAMED  # or OP_NUMERIC, decided below
        else:
            kind = KIND_CALL
    R[i, R_OP] = op
    if kind == KIND_CALL:
        q = t
        for fi in range(10):
            q = _lit(buf, q, n, fi)
            if q < 0:
                return -1, -1
            fk = _CALL_KIND[fi]
            if fk == F_PTR:
                v, q = _ptr(buf, q, n)
            elif fk == F_HEX:
                v = np.int64(0)
                k = q
                while k < n and _HEXV[buf[k]] >= 0 and k - q < 16:
                    v = v * 16 + _HEXV[buf[k]]
                    k += 1
                q = k if k > q and k - q <= _CALL_MAXD[fi] else -1
            else:
                v, q = _int(buf, q, n, _CALL_MAXD[fi], fk == F_SINT)
            if q < 0:
                return -1, -1
            R[i, _CALL_COL[fi]] = v
        e = _line_end(buf, q, n)
        count = R[i, R_COUNT]
        dtype = R[i, R_DTYPE]
        # a datatype the kernel decodes; bytes and message bytes (<= count x 8 x nranks) in int64
        if e < 0 or dtype < 0 or dtype >= N_DATATYPES or abs(count) > _INT64_MAX // (8 * max(R[i, R_NRANKS], 1)):
            return -1, -1
        return kind, e
    q = _lit(buf, q, n, L_BYTES_ALGO)
    if q < 0 or q >= n:
        return -1, -1
    if _CC[buf[q]] & CC_DIGIT:
        if kind == KIND_TUNE_NAMED:
            kind = KIND_TUNE_OP_NUMERIC
        algo, q = _int(buf, q, n, 18, False)
        if q < 0 or algo >= _ALGO_LENS.shape[0]:
            return -1, -1
        q = _lit(buf, q, n, L_PROTO)
        proto, q = _int(buf, q, n, 18, False)
        if q < 0 or proto >= _PROTO_LENS.shape[0]:
            return -1, -1
        q = _lit(buf, q, n, L_TIME)
        if q < 0 or q >= n:
            return -1, -1
        # float(): -?\d+(\.\d+)? with <= 15 digits is M / 10^k, correctly rounded.
        neg = buf[q] == 45
        if neg:
            q += 1
        mant, k = _int(buf, q, n, 15, False)
        if k < 0:
            return -1, -1
        nd = k - q
        nfrac = 0
        if k < n and buf[k] == 46:
            frac, k2 = _int(buf, k + 1, n, 15, False)
            if k2 < 0:
                return -1, -1
            nfrac = k2 - k - 1
            if nd + nfrac > 15:
                return -1, -1
            for _ in range(nfrac):
                mant *= 10
            mant += frac
            k = k2
        e = _line_end(buf, k, n)
        if e < 0:
            return -1, -1
        tval = np.float64(mant) / _POW10[nfrac]
        T[i] = -tval if neg else tval
        lo = hi = np.int64(0)
    else:
        if kind != KIND_TUNE_NAMED:
            return -1, -1
        k = _word_end(buf, q, n)
        algo = _lookup(buf, q, k, 1)
        q = _lit(buf, k, n, L_PROTO)
        if algo < 0 or q < 0:
            return -1, -1
        k = _word_end(buf, q, n)
        proto = _lookup(buf, q, k, 2)
        q = _lit(buf, k, n, L_CHANNEL)
        if proto < 0 or q < 0:
            return -1, -1
        lo, q = _int(buf, q, n, 9, False)
        q = _lit(buf, q, n, L_DOTDOT)
        hi, q = _int(buf, q, n, 9, False)
        if q < 0 or q >= n or buf[q] != 125:
            return -1, -1
        e = _line_end(buf, q + 1, n)
        if e < 0:
            return -1, -1
        T[i] = 0.0
    R[i, R_BYTES] = nbytes
    R[i, R_ALGO] = algo
    R[i, R_PROTO] = proto
    R[i, R_LO] = lo
    R[i, R_HI] = hi
    return kind, e


# --- block scanner ----------------------------------------------------------------------
@njit((_BUF, _I, _I, _M, _R, _arr(nt.float64)), cache=True, nogil=True)
def scan_block(buf, n, first_lineno, S, R, T):
    """Scan the lines of ``buf[:n]`` (line numbers from ``first_lineno``): the lines the kernel takes
    become rows of R (and T), the others rows (start, end, line) of S. R, S and T need a row per line.

    ``buf[:n]`` must hold whole lines (the last one may lack its newline only at the end of the
    file). Returns (lines, rows of S, rows of R).
    """
    nf = 0
    ns = 0
    lineno = first_lineno
    pos = 0
    have_prev = False
    p_ls = p_tss = p_tse = p_ip = 0
    p_wk = WALL_NONE
    while pos < n:
        ls = pos
        ok = False
        e = -1
        ip = -1
        wk = WALL_NONE
        wall = np.int64(0)
        tss = tse = ls
        # 0. Same prefix as the previous fast record (a timestamp at the line start re-read): the
        # checks of steps 1-2 hold as they did for that record.
        quick = False
        if have_prev and p_tss == p_ls:
            status = 1
            tend = ls
            if p_wk == WALL_LOCAL:
                status, tend, wall = _bracket_ts(buf, ls, n)
            elif p_wk == WALL_EPOCH:
                status = 0
                if _CC[buf[ls]] & CC_DIGIT:
                    status, _r, tend, wall = _epoch_at(buf, ls, n)
            if status == 1:
                m = p_ip - p_tse
                if _level(buf, tend + m, n) == 1 and _same(buf, tend, p_tse, m):
                    ip = tend + m
                    wk = p_wk
                    tse = tend
                    quick = True
            if not quick:
                wall = np.int64(0)
        # 1. the level token: the first "NCCL INFO ", no "NCCL WARN " before it, ASCII only, no NUL
        # (the reader reports lines with NUL bytes as damage).
        p = ls
        while not quick and p < n:
            c = buf[p]
            if c == 10 or c >= 128 or c == 0:
                break
            if c == 78:
                lv = _level(buf, p, n)
                if lv == 1:
                    ip = p
                if lv != 0:
                    break
            p += 1
        while ip >= 0:  # one pass; 'break' = not a fast line
            # 2. the prefix and its timestamp.
            if not quick:
                okp, wk, wall, tss, tse = _prefix(buf, ls, ip)
                if not okp:
                    break
            # 3. the message.
            kind, e = _message(buf, ip + 10, n, nf, R, T)
            if kind < 0:
                break
            # 4. a fast record: does its prefix (timestamp cut out) differ from the previous one?
            change = not quick
            if not quick and have_prev and wk == p_wk and tss - ls == p_tss - p_ls and ip - tse == p_ip - p_tse:
                change = not (_same(buf, ls, p_ls, tss - ls) and _same(buf, tse, p_tse, ip - tse))
            have_prev = True
            p_ls, p_tss, p_tse, p_ip, p_wk = ls, tss, tse, ip, wk
            R[nf, R_LINE] = lineno
            R[nf, R_KIND] = kind
            R[nf, R_TIDNULL] = 0
            R[nf, R_WALL] = wall
            R[nf, R_WALLNULL] = 1 if wk == WALL_NONE else 0
            R[nf, R_LS] = ls
            R[nf, R_IP] = ip
            R[nf, R_CHANGE] = 1 if change else 0
            R[nf, R_WK] = wk
            nf += 1
            ok = True
            break
        if ok:
            pos = e + 1
        else:
            q = ls
            while q < n and buf[q] != 10:
                q += 1
            S[ns, 0] = ls
            S[ns, 1] = q + 1 if q < n else n
            S[ns, 2] = lineno
            ns += 1
            pos = q + 1
        lineno += 1
    return lineno - first_lineno, ns, nf


@njit((_BUF, _I), cache=True, nogil=True)
def count_lines(buf, n):
    nl = 0
    for i in range(n):
        if buf[i] == 10:
            nl += 1
    return nl


def scan(buf: np.ndarray, n: int, first_lineno: int) -> tuple[int, np.ndarray, np.ndarray, np.ndarray]:
    """Run :func:`scan_block` on ``buf[:n]`` (a contiguous uint8 array of whole lines).

    Returns (lines, S, R, T): S rows (start, end with the newline, line) of the lines left to the
    reader; R/T the records (see the R_* columns). R_HID, R_PID, R_TID and, for calls, R_BYTES are
    left to the caller (they depend on the reader's prefix and version state); fields that do not
    apply to a record's kind hold garbage.
    """
    cap = count_lines(buf, n) + 2  # >= 2 rows: an F-ordered R of one row would also be C-ordered
    S = np.empty((cap, 3), np.int64)
    R = np.empty((cap, R_NFIELDS), np.int64, order="F")
    T = np.empty(cap, np.float64)
    lines, ns, nf = scan_block(buf, n, first_lineno, S, R, T)
    return lines, S[:ns], R[:nf], T[:nf]


@njit((_arr(_I), _arr(_I), _arr(nt.uint8)), cache=True, nogil=True)
def gather_strings(codes, offsets, data):
    """Arrow string column (int32 offsets, bytes) of ``names[codes]`` for a table given as
    ``offsets``/``data`` (name i = data[offsets[i]:offsets[i + 1]])."""
    n = codes.shape[0]
    out_off = np.empty(n + 1, np.int32)
    total = 0
    out_off[0] = 0
    for i in range(n):
        c = codes[i]
        total += offsets[c + 1] - offsets[c]
        out_off[i + 1] = total
    out = np.empty(total, np.uint8)
    for i in range(n):
        c = codes[i]
        a = offsets[c]
        o = out_off[i]
        for k in range(offsets[c + 1] - a):
            out[o + k] = data[a + k]
    return out_off, out


# --- order-dependent state: duplicate calls and TUNING attachment -----------------------
# Signature of a call: columns R_OP .. R_WALLNULL except R_COMM (part of the key) and R_BYTES.
_SIG_COLS = np.array([R_OP, R_OPC, R_SEND, R_RECV, R_COUNT, R_DTYPE, R_REDOP, R_ROOT, R_NRANKS, R_STREAM, R_TID,
                      R_TIDNULL, R_WALL, R_WALLNULL], np.int64)
_SIG = 14


@njit((nt.Array(_B, 1, "C"), _M, _I, _I, _I), cache=True)
def _find(ht_used, ht_key, hid, pid, comm):
    """Slot of key (host id, pid id, comm) in the open-addressing table, and whether it is there."""
    cap = ht_used.shape[0]
    h = np.uint64(hid) * np.uint64(0x9E3779B97F4A7C15)
    h ^= np.uint64(pid) * np.uint64(0xC2B2AE3D27D4EB4F)
    h ^= np.uint64(comm) * np.uint64(0x165667B19E3779F9)
    h ^= h >> np.uint64(29)
    s = np.int64(h & np.uint64(cap - 1))
    while ht_used[s]:
        if ht_key[s, 0] == hid and ht_key[s, 1] == pid and ht_key[s, 2] == comm:
            return s, True
        s = (s + 1) & (cap - 1)
    return s, False


@njit((_I, _I, _I, _B, _M, _M, _M, _M, _M, nt.Array(_B, 2, "C"), _arr(_I), _arr(_I)), cache=True)
def _attach(p, op, nbytes, full, r_line, r_op, r_bytes, r_nranks, r_opc, r_tuned, r_head, r_len):
    """_FileParser._attach_tuning on the ring of pid id ``p``: (status, call line, n calls).

    status 1 = an intermediate value may leave int64: the caller decides in Python, exactly.
    """
    if p >= r_len.shape[0]:
        return 0, np.int64(-1), 0
    L = r_len[p]
    if L == 0:
        return 0, np.int64(-1), 0
    W = r_line.shape[1]
    base = r_head[p] - L + W
    for k in range(L - 1, -1, -1):
        s = (base + k) % W
        o = r_op[p, s]
        if r_tuned[p, s] or (op >= 0 and o != op) or o == OP_SEND or o == OP_RECV:
            continue
        b = r_bytes[p, s]
        if full and (o == OP_ALLGATHER or o == OP_REDUCESCATTER):
            if abs(np.float64(b) * np.float64(r_nranks[p, s])) >= 9.0e18:
                return 1, np.int64(-1), 0
            b = b * r_nranks[p, s]
        if b == nbytes:
            r_tuned[p, s] = True
            return 0, r_line[p, s], 1
    if full:
        for k in range(L - 1, -1, -1):
            s = (base + k) % W
            o = r_op[p, s]
            if r_tuned[p, s] or (op >= 0 and o != op) or o == OP_SEND or o == OP_RECV:
                continue
            c_opc = r_opc[p, s]
            total = np.int64(0)
            j = k
            cnt = 0
            while j >= 0:
                sj = (base + j) % W
                if r_op[p, sj] != o or r_opc[p, sj] != c_opc or r_tuned[p, sj]:
                    break
                b = r_bytes[p, sj]
                if o == OP_ALLGATHER or o == OP_REDUCESCATTER:
                    if abs(np.float64(b) * np.float64(r_nranks[p, sj])) >= 9.0e18:
                        return 1, np.int64(-1), 0
                    b = b * r_nranks[p, sj]
                if abs(np.float64(total) + np.float64(b)) >= 9.0e18:
                    return 1, np.int64(-1), 0
                total += b
                cnt += 1
                if total == nbytes and cnt > 1:
                    for i in range(j, k + 1):
                        r_tuned[p, (base + i) % W] = True
                    return 0, r_line[p, sj], cnt
                j -= 1
            break
    return 0, np.int64(-1), 0


@njit((_A, _A, _I, _I, nt.Array(_B, 1, "C"), _M, _M, _arr(_I), nt.Array(_B, 1, "C"), nt.Array(_B, 1, "C"),
       _arr(_I), _M, _M, _M, _M, _M, nt.Array(_B, 2, "C"), _arr(_I), _arr(_I), _M, _M, _arr(_I)),
      cache=True, nogil=True)
def apply_state(F, S, fi, si, ht_used, ht_key, ht_sig, ht_line, ht_has, ht_adv, ht_n,
                r_line, r_op, r_bytes, r_nranks, r_opc, r_tuned, r_head, r_len, f_out, s_out, counts):
    """Replay duplicate detection and TUNING attachment over the fast records F and the Python-side
    lines S (both in the R_* layout, each in line order), merged by line, from rows (fi, si).

    Writes (duplicate_of or call_line or -1, n_calls) to f_out/s_out. Returns (status, fi, si): 0 =
    done; 1 = the hash table must grow before row (fi, si); 2 = the TUNING line at (fi, si) must be
    attached in Python (int64 overflow). ``counts``: [duplicates, identical repeats kept, TUNING lines
    not attached].
    """
    nf = F.shape[0]
    ns = S.shape[0]
    cap = ht_used.shape[0]
    W = r_line.shape[1]
    while fi < nf or si < ns:
        fast = si >= ns or (fi < nf and F[fi, R_LINE] < S[si, R_LINE])
        M = F if fast else S
        i = fi if fast else si
        out = f_out if fast else s_out
        line = M[i, R_LINE]
        kind = M[i, R_KIND]
        pid = M[i, R_PID]
        op = M[i, R_OP]
        if kind == KIND_CALL or kind == KIND_CALL_NOTUNE:
            hid = M[i, R_HID]
            comm = M[i, R_COMM]
            s, found = _find(ht_used, ht_key, hid, pid, comm)
            if not found:
                if 2 * (ht_n[0] + 1) > cap:
                    return 1, fi, si
                ht_used[s] = True
                ht_key[s, 0] = hid
                ht_key[s, 1] = pid
                ht_key[s, 2] = comm
                ht_has[s] = False
                ht_adv[s] = False
                ht_n[0] += 1
            if M[i, R_OPC] > 0:
                ht_adv[s] = True
            same = ht_has[s]
            if same:
                for k in range(_SIG):
                    if ht_sig[s, k] != M[i, _SIG_COLS[k]]:
                        same = False
                        break
            dup = np.int64(-1)
            if same and M[i, R_NRANKS] > 1 and ht_adv[s]:
                dup = ht_line[s]
                counts[0] += 1
            else:
                if same:
                    counts[1] += 1
                for k in range(_SIG):
                    ht_sig[s, k] = M[i, _SIG_COLS[k]]
                ht_line[s] = line
                ht_has[s] = True
            if dup < 0 and kind == KIND_CALL:
                # remember it for TUNING attachment (deque of the last W calls of the pid)
                h = r_head[pid]
                r_line[pid, h] = line
                r_op[pid, h] = op
                r_bytes[pid, h] = M[i, R_BYTES]
                r_nranks[pid, h] = M[i, R_NRANKS]
                r_opc[pid, h] = M[i, R_OPC]
                r_tuned[pid, h] = False
                r_head[pid] = (h + 1) % W
                if r_len[pid] < W:
                    r_len[pid] += 1
            out[i, 0] = dup
        else:
            status, cl, nc = _attach(pid, op, M[i, R_BYTES], kind >= 2, r_line, r_op, r_bytes, r_nranks, r_opc,
                                     r_tuned, r_head, r_len)
            if status != 0:
                return 2, fi, si
            if cl < 0:
                counts[2] += 1
            out[i, 0] = cl
            out[i, 1] = nc
        if fast:
            fi += 1
        else:
            si += 1
    return 0, fi, si


class FastState:
    """Per-file state of :func:`apply_state` (numpy arrays, grown on demand)."""

    def __init__(self, window: int = TUNE_WINDOW) -> None:
        self.window = window
        self._alloc_table(64)
        self.ht_n = np.zeros(1, np.int64)
        self.r_line = np.zeros((0, window), np.int64)
        self.r_op = np.zeros((0, window), np.int64)
        self.r_bytes = np.zeros((0, window), np.int64)
        self.r_nranks = np.zeros((0, window), np.int64)
        self.r_opc = np.zeros((0, window), np.int64)
        self.r_tuned = np.zeros((0, window), np.bool_)
        self.r_head = np.zeros(0, np.int64)
        self.r_len = np.zeros(0, np.int64)
        self.counts = np.zeros(3, np.int64)

    def _alloc_table(self, cap: int) -> None:
        self.ht_used = np.zeros(cap, np.bool_)
        self.ht_key = np.zeros((cap, 3), np.int64)
        self.ht_sig = np.zeros((cap, _SIG), np.int64)
        self.ht_line = np.zeros(cap, np.int64)
        self.ht_has = np.zeros(cap, np.bool_)
        self.ht_adv = np.zeros(cap, np.bool_)

    def grow_table(self) -> None:
        used, key, sig, line, has, adv = (self.ht_used, self.ht_key, self.ht_sig, self.ht_line, self.ht_has,
                                          self.ht_adv)
        self._alloc_table(2 * used.shape[0])
        for s in np.flatnonzero(used).tolist():
            t, _ = _find(self.ht_used, self.ht_key, key[s, 0], key[s, 1], key[s, 2])
            self.ht_used[t] = True
            self.ht_key[t] = key[s]
            self.ht_sig[t] = sig[s]
            self.ht_line[t] = line[s]
            self.ht_has[t] = has[s]
            self.ht_adv[t] = adv[s]

    def ensure_pids(self, n: int) -> None:
        have = self.r_head.shape[0]
        if n <= have:
            return
        new = max(n, 2 * have, 4)
        for name in ("r_line", "r_op", "r_bytes", "r_nranks", "r_opc", "r_tuned"):
            old = getattr(self, name)
            arr = np.zeros((new, self.window), old.dtype)
            arr[:have] = old
            setattr(self, name, arr)
        for name in ("r_head", "r_len"):
            old = getattr(self, name)
            arr = np.zeros(new, old.dtype)
            arr[:have] = old
            setattr(self, name, arr)

    def attach_exact(self, p: int, op: int, nbytes: int, full: bool) -> tuple[int, int]:
        """_FileParser._attach_tuning on the ring of pid id ``p`` with Python integers."""
        if p >= self.r_len.shape[0] or self.r_len[p] == 0:
            return -1, 0
        W = self.window
        L = int(self.r_len[p])
        slots = [(int(self.r_head[p]) - L + k) % W for k in range(L)]
        ops = [int(self.r_op[p, s]) for s in slots]
        nb = [int(self.r_bytes[p, s]) for s in slots]
        nr = [int(self.r_nranks[p, s]) for s in slots]
        opc = [int(self.r_opc[p, s]) for s in slots]
        tuned = self.r_tuned[p]
        gather = (OP_ALLGATHER, OP_REDUCESCATTER)
        p2p = (OP_SEND, OP_RECV)
        for i in range(L - 1, -1, -1):
            if tuned[slots[i]] or (op >= 0 and ops[i] != op) or ops[i] in p2p:
                continue
            expect = nb[i] * nr[i] if full and ops[i] in gather else nb[i]
            if expect == nbytes:
                tuned[slots[i]] = True
                return int(self.r_line[p, slots[i]]), 1
        if full:
            for i in range(L - 1, -1, -1):
                if tuned[slots[i]] or (op >= 0 and ops[i] != op) or ops[i] in p2p:
                    continue
                total = 0
                j = i
                group = []
                while j >= 0 and ops[j] == ops[i] and opc[j] == opc[i] and not tuned[slots[j]]:
                    total += nb[j] * nr[j] if ops[i] in gather else nb[j]
                    group.append(j)
                    if total == nbytes and len(group) > 1:
                        for g in group:
                            tuned[slots[g]] = True
                        return int(self.r_line[p, slots[group[-1]]]), len(group)
                    j -= 1
                break
        return -1, 0

    def run(self, F: np.ndarray, S: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Apply the state to a block: fast records F and Python-side lines S (R_* layout, line order).
        Returns the (n, 2) outputs of :func:`apply_state` for F and S."""
        f_out = np.full((F.shape[0], 2), -1, np.int64)
        s_out = np.full((S.shape[0], 2), -1, np.int64)
        f_out[:, 1] = 0
        s_out[:, 1] = 0
        fi = si = 0
        while True:
            status, fi, si = apply_state(F, S, fi, si, self.ht_used, self.ht_key, self.ht_sig, self.ht_line,
                                         self.ht_has, self.ht_adv, self.ht_n, self.r_line, self.r_op, self.r_bytes,
                                         self.r_nranks, self.r_opc, self.r_tuned, self.r_head, self.r_len, f_out,
                                         s_out, self.counts)
            if status == 0:
                return f_out, s_out
            if status == 1:
                self.grow_table()
                continue
            # status 2: a TUNING line whose candidates overflow int64 -> exact Python arithmetic
            fast = si >= S.shape[0] or (fi < F.shape[0] and F[fi, R_LINE] < S[si, R_LINE])
            M, i, out = (F, fi, f_out) if fast else (S, si, s_out)
            cl, nc = self.attach_exact(int(M[i, R_PID]), int(M[i, R_OP]), int(M[i, R_BYTES]), int(M[i, R_KIND]) >= 2)
            out[i] = cl, nc
            if cl < 0:
                self.counts[2] += 1
            if fast:
                fi += 1
            else:
                si += 1
