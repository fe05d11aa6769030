"""Merkle tree: CT known answers, pymerkle (independent implementation), and the naive reference
in ``independent.py`` written from RFC 6962/9162 §2.1 (MTH, PATH, PROOF / SUBPROOF)."""

import hashlib
import random
import warnings

import pytest
from pymerkle import InmemoryTree

from auditor import merkle as mk
from tests.auditor import independent as ind


def _leaves(d: list[bytes]) -> list[bytes]:
    return [ind.leaf(x) for x in d]


def ref_mth(d: list[bytes]) -> bytes:
    return ind.mth(_leaves(d))


def ref_path(m: int, d: list[bytes]) -> list[bytes]:
    return ind.path(m, _leaves(d))


def ref_proof(m: int, d: list[bytes]) -> list[bytes]:
    return ind.proof(m, _leaves(d))


CT_LEAVES = ["", "00", "10", "2021", "3031", "40414243", "5051525354555657", "606162636465666768696a6b6c6d6e6f"]
CT_ROOTS = {
    1: "6e340b9cffb37a989ca544e6bb780a2c78901d3fb33738768511a30617afa01d",
    2: "fac54203e7cc696cf0dfcb42c92a1d9dbaf70ad9e621f4bd8d98662f00e3c125",
    3: "aeb6bcfe274b70a14fb067a5e5578264db0fa9b51af5e0ba159158f329e06e77",
    4: "d37ee418976dd95753c1c73862b9398fa2a2cf9b4ff0fdfe8b30cd95209614b7",
    5: "4e3bbb1f7b478dcfe71fb631631519a3bca12c9aefca1612bfce4c13a86264d4",
    6: "76e67dadbcdf1e10e1b74ddc608abd2f98dfb16fbce75277b5232a127f2087ef",
    7: "ddb89be403809e325750d3d263cd78929c2942b7942a34b77e122c9594a74c8c",
    8: "5dc9da79a70659a9ad559cb701ded9a2ab9d823aad2f4960cfe370eff4604328",
}


def make_tree(data: list[bytes]) -> mk.MerkleTree:
    tree = mk.MerkleTree()
    for i, x in enumerate(data):
        assert tree.append(x) == i
    return tree


def test_certificate_transparency_roots() -> None:
    tree = make_tree([bytes.fromhex(x) for x in CT_LEAVES])
    assert tree.root(0) == hashlib.sha256(b"").digest() == mk.EMPTY_ROOT
    for n, root in CT_ROOTS.items():
        assert tree.root(n).hex() == root


def test_against_pymerkle() -> None:
    rng = random.Random(6962)
    data = [rng.randbytes(rng.randrange(0, 40)) for _ in range(70)]
    ours, theirs = make_tree(data), InmemoryTree(algorithm="sha256")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for n, x in enumerate(data, start=1):
            theirs.append_entry(x)
            assert ours.root(n) == theirs.get_root()
            for i in rng.sample(range(n), min(n, 4)):
                path = [bytes.fromhex(h) for h in theirs.prove_inclusion(i + 1, n).serialize()["path"]]
                assert path[0] == ours.leaf_hash(i)  # pymerkle puts the leaf first, then the RFC path
                assert ours.inclusion_proof(i, n) == path[1:]


def _tamper(proof: list[bytes], rng: random.Random) -> list[bytes]:
    bad = list(proof)
    j = rng.randrange(len(bad))
    flipped = bytearray(bad[j])
    flipped[rng.randrange(32)] ^= 1 << rng.randrange(8)
    bad[j] = bytes(flipped)
    return bad


def _check_inclusion(tree: mk.MerkleTree, data: list[bytes], i: int, n: int, rng: random.Random) -> None:
    proof = tree.inclusion_proof(i, n)
    assert proof == ref_path(i, data[:n])
    root, leaf = ref_mth(data[:n]), mk.leaf_hash(data[i])
    mk.verify_inclusion(leaf, i, n, proof, root)
    # (the tree size alone is not bound by a path: the signed checkpoint binds size and root together)
    negatives = [(leaf, i, n, proof + [root]), (mk.leaf_hash(b"x" + data[i]), i, n, proof)]
    if proof:
        negatives += [(leaf, i, n, _tamper(proof, rng)), (leaf, i, n, proof[:-1])]
    if n > 1:
        negatives.append((leaf, (i + 1) % n, n, proof))
    for args in negatives:
        with pytest.raises(mk.ProofError):
            mk.verify_inclusion(*args, root)
    if n < len(data):
        with pytest.raises(mk.ProofError):
            mk.verify_inclusion(leaf, i, n, proof, ref_mth(data[: n + 1]))


def _check_consistency(tree: mk.MerkleTree, data: list[bytes], m: int, n: int, rng: random.Random) -> None:
    proof = tree.consistency_proof(m, n)
    assert proof == ([] if m in (0, n) else ref_proof(m, data[:n]))
    old, new = ref_mth(data[:m]), ref_mth(data[:n])
    mk.verify_consistency(m, n, old, new, proof)
    wrong = hashlib.sha256(b"wrong").digest()
    negatives = [(m, n, wrong, new, proof), (m, n, old, new, proof + [old])]
    if m > 0:  # the empty tree is consistent with every tree, whatever its root
        negatives.append((m, n, old, wrong, proof))
    if proof:
        negatives += [(m, n, old, new, _tamper(proof, rng)), (m, n, old, new, proof[:-1])]
    if 0 < m < n:
        negatives.append((m - 1, n, ref_mth(data[: m - 1]), new, proof))
    for args in negatives:
        with pytest.raises(mk.ProofError):
            mk.verify_consistency(*args)


def test_randomized_sizes_1_to_200_against_reference() -> None:
    rng = random.Random(9162)
    data = [rng.randbytes(8) for _ in range(200)]
    tree = make_tree(data)
    for n in range(1, 201):
        indices = range(n) if n <= 20 else rng.sample(range(n), 3) + [0, n - 1]
        for i in indices:
            _check_inclusion(tree, data, i, n, rng)
        olds = range(0, n + 1) if n <= 20 else rng.sample(range(1, n), 3) + [0, 1, n - 1, n]
        for m in olds:
            _check_consistency(tree, data, m, n, rng)


def test_incremental_tree_matches_rebuilt_tree() -> None:
    data = [bytes([i]) for i in range(37)]
    tree = make_tree(data)
    rebuilt = mk.MerkleTree(tree.leaf_hashes())
    assert rebuilt.root() == tree.root() == ref_mth(data)
    assert rebuilt.consistency_proof(13) == tree.consistency_proof(13, 37)


def test_out_of_range_requests_fail_loudly() -> None:
    tree = make_tree([b"a", b"b", b"c"])
    with pytest.raises(mk.ProofError, match="leaf index 3 is outside a tree of size 3"):
        tree.inclusion_proof(3)
    with pytest.raises(mk.ProofError, match="tree size 4 is outside"):
        tree.root(4)
    with pytest.raises(mk.ProofError, match="old size 4"):
        tree.consistency_proof(4, 3)
    with pytest.raises(mk.ProofError, match="leaf index 5"):
        mk.verify_inclusion(tree.leaf_hash(0), 5, 3, [], tree.root())
    with pytest.raises(ValueError, match="32 bytes"):
        tree.append_leaf_hash(b"short")


def test_proof_json_roundtrip_and_errors() -> None:
    tree = make_tree([bytes([i]) for i in range(9)])
    proof = mk.InclusionProof(4, 9, tuple(tree.inclusion_proof(4)))
    assert mk.InclusionProof.from_json(proof.to_json()) == proof
    cons = mk.ConsistencyProof(3, 9, tuple(tree.consistency_proof(3)))
    assert mk.ConsistencyProof.from_json(cons.to_json()) == cons
    with pytest.raises(mk.ProofError, match="proof hash 0 is not base64"):
        mk.InclusionProof.from_json({"log_index": 0, "tree_size": 1, "hashes": ["@@"]})
    with pytest.raises(mk.ProofError, match="integer log_index"):
        mk.InclusionProof.from_json({"log_index": "0", "tree_size": 1, "hashes": []})
