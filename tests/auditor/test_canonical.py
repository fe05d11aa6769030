"""The canonical encoding, checked against hand-built bytes (hashlib / struct / numpy)."""

import hashlib
import struct

import numpy as np
import pytest
import rfc8785

from auditor import canonical as cn

SALT = bytes(range(32))


def test_jcs_sorts_keys_and_drops_whitespace() -> None:
    assert cn.canonical_json({"b": 1, "a": [True, None, "é"]}) == '{"a":[true,null,"é"],"b":1}'.encode()


def test_jcs_number_forms() -> None:
    assert cn.canonical_json([1.0, 0.1, 1e21, -0.0, 2**53 - 1]) == b"[1,0.1,1e+21,0,9007199254740991]"


def test_jcs_refuses_integers_beyond_2_53() -> None:
    with pytest.raises(rfc8785.IntegerDomainError):
        cn.canonical_json({"seed": 2**53 + 1})


def test_seed_kept_as_decimal_string() -> None:
    big = 2**64 - 1
    assert cn.canonical_json({"seed": cn.seed_to_str(big)}) == b'{"seed":"18446744073709551615"}'
    for bad in (-1, 2**64, True, "5"):
        with pytest.raises(ValueError):
            cn.seed_to_str(bad)  # type: ignore[arg-type]


def test_pack_u32le_bytes() -> None:
    assert cn.pack_u32le([1, 0x01020304, 2**32 - 1]) == b"\x01\0\0\0" b"\x04\x03\x02\x01" b"\xff\xff\xff\xff"
    assert cn.pack_u32le([]) == b""


@pytest.mark.parametrize("bad", [-1, 2**32, 1.0, True])
def test_pack_u32le_rejects(bad: object) -> None:
    with pytest.raises(ValueError, match="index 1"):
        cn.pack_u32le([0, bad])  # type: ignore[list-item]


def test_commitments_by_hand() -> None:
    ids = [128000, 9906, 1917]
    want = hashlib.sha256(SALT + struct.pack("<3I", *ids)).hexdigest()
    assert cn.prompt_commitment(SALT, ids) == want
    assert cn.output_commitment(SALT, ids) == want
    assert cn.output_commitment(SALT, ids[:2]) != want
    assert cn.output_commitment(bytes(32), ids) != want


def test_salt_must_be_32_bytes() -> None:
    with pytest.raises(ValueError, match="32 bytes, got 31"):
        cn.output_commitment(bytes(31), [1])


def test_window_chain_by_hand() -> None:
    out = [7, 8, 9, 10, 11]
    windows = [(1, 3), (3, 5)]
    h = hashlib.sha256(b"verbatim-windows-v1" + SALT).digest()
    expected = []
    for s, e in windows:
        h = hashlib.sha256(h + struct.pack("<II", s, e) + struct.pack(f"<{e - s}I", *out[s:e])).digest()
        expected.append(h.hex())
    assert cn.window_chain(SALT, windows, out) == expected
    assert cn.window_chain_head(SALT, windows, out) == expected[-1]


def test_window_chain_empty_and_sensitivity() -> None:
    out = [1, 2, 3]
    assert cn.window_chain_head(SALT, [], out) == hashlib.sha256(b"verbatim-windows-v1" + SALT).hexdigest()
    base = cn.window_chain_head(SALT, [(1, 3)], out)
    assert cn.window_chain_head(SALT, [(1, 2), (2, 3)], out) != base
    assert cn.window_chain_head(SALT, [(1, 3)], [1, 2, 4]) != base
    assert cn.window_chain_head(SALT, [(1, 3)], [9, 2, 3]) == base  # token 0 is outside every window


def test_window_chain_rejects_bad_spans() -> None:
    with pytest.raises(ValueError, match=r"window 1 = \(3, 5\)"):
        cn.window_chain(SALT, [(1, 3), (3, 5)], [1, 2, 3, 4])


def test_logprob_digest_is_float32_le() -> None:
    lp = [-0.1, -2.5, 0.0, -1e-9]
    want = hashlib.sha256(np.asarray(lp, dtype="<f4").tobytes()).hexdigest()
    assert cn.logprob_digest(lp) == want
    assert cn.logprob_digest([-0.1, -2.5, 0.0, -2e-9]) != want


def test_envelope_digest_is_key_order_independent() -> None:
    a = {"payload": "eA==", "payloadType": "t", "signatures": [{"keyid": "k", "sig": "cw=="}]}
    b = {"signatures": [{"sig": "cw==", "keyid": "k"}], "payloadType": "t", "payload": "eA=="}
    assert cn.envelope_digest(a) == cn.envelope_digest(b) == hashlib.sha256(cn.canonical_json(a)).hexdigest()
