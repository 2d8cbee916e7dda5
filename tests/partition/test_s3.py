"""Partition stores in S3 (dorylus.partition.s3), against moto's S3 server over real HTTP.

The server runs in this process on 127.0.0.1 (a free port) and is always stopped; boto3 finds
it through ``AWS_ENDPOINT_URL_S3``, exactly as a user would point dorylus at another S3.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import boto3
import numpy as np
import pytest

from dorylus import cli
from dorylus.data.graph import GraphDataset
from dorylus.errors import ConfigError, StoreError
from dorylus.partition import open_store, write_store
from dorylus.partition.s3 import MiB, fetch_store, parse_s3_url, read_store_meta, upload_store

moto_server = pytest.importorskip("moto.server")
_buckets = itertools.count()


@pytest.fixture(scope="module")
def s3_endpoint():
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        yield f"http://{host}:{port}"
    finally:
        server.stop()


@pytest.fixture
def bucket(s3_endpoint, monkeypatch, tmp_path) -> str:
    """A fresh bucket; credentials, endpoint and the store cache point at test-only places."""
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "DORYLUS_CACHE_DIR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", s3_endpoint)
    monkeypatch.setenv("DORYLUS_STORE_CACHE", str(tmp_path / "cache"))
    name = f"dorylus-test-{next(_buckets)}"
    boto3.client("s3").create_bucket(Bucket=name)
    return name


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory) -> Path:
    """A 2-part store whose part 0 features (5.8 MB) take a multipart upload in 5 MiB parts."""
    rng = np.random.default_rng(0)
    n, f = 3000, 600
    masks = rng.random((3, n))
    dataset = GraphDataset(
        name="s3-toy", src=rng.integers(0, n, 6000), dst=rng.integers(0, n, 6000),
        features=rng.standard_normal((n, f)).astype(np.float32), labels=rng.integers(0, 4, n),
        train_mask=masks[0] < 0.3, val_mask=(masks[0] >= 0.3) & (masks[0] < 0.5), test_mask=masks[0] >= 0.5,
        num_classes=4)
    out = tmp_path_factory.mktemp("store") / "toy"
    write_store(dataset, (np.arange(n) >= 2400).astype(np.int64), out, method="contiguous", seed=0)
    return out


def exit_status(argv: list[str]) -> int:
    try:
        return cli.main(argv)
    except SystemExit as exc:
        return exc.code


def cache_entries(tmp_path: Path) -> list[str]:
    cache = tmp_path / "cache"
    return sorted(p.name for p in cache.iterdir()) if cache.exists() else []


def test_upload_then_open_the_s3_url_gives_the_same_store(bucket, store_dir, tmp_path):
    url = f"s3://{bucket}/stores/toy/"
    uploaded = upload_store(store_dir, url, part_bytes=5 * MiB)
    original = open_store(store_dir)
    assert uploaded.url == f"s3://{bucket}/stores/toy" and uploaded.files == len(original.meta.files) + 1
    client = boto3.client("s3")
    head = client.head_object(Bucket=bucket, Key="stores/toy/part-0/features.npy")
    assert head["ETag"].endswith('-2"'), "the big file should have gone up in 2 parts"
    assert head["Metadata"]["sha256"] == original.meta.files["part-0/features.npy"]

    store = open_store(url, verify=True)
    assert store.path.parent == tmp_path / "cache" and store.fingerprint() == original.fingerprint()
    for rel in [*original.meta.files, "meta.json"]:
        assert (store.path / rel).read_bytes() == (store_dir / rel).read_bytes(), rel
    assert np.array_equal(store.load_part(0).features, original.load_part(0).features)
    assert cache_entries(tmp_path) == [store.path.name]  # no temp directories left

    # A second open downloads nothing: the cached copy is used.
    client.delete_object(Bucket=bucket, Key="stores/toy/part-1/indices.npy")
    assert open_store(url).path == store.path


def test_a_graph_server_fetches_only_its_part(bucket, store_dir, tmp_path):
    url = f"s3://{bucket}/toy"
    upload_store(store_dir, url)
    meta = read_store_meta(url)  # what a parameter server needs: no part is downloaded
    assert (meta.num_features, meta.num_classes, meta.num_parts) == (600, 4, 2) and cache_entries(tmp_path) == []
    root = fetch_store(url, parts=[1])
    assert sorted(p.name for p in root.iterdir()) == ["meta.json", "part-1"]
    store = open_store(url, verify=True, parts=[1])
    assert store.path == root and store.load_part(1).n_owned == 600
    assert fetch_store(url) == root  # the other part joins the same cache entry
    assert sorted(p.name for p in root.iterdir()) == ["meta.json", "part-0", "part-1"]
    assert cache_entries(tmp_path) == [root.name]


def test_cli_upload_and_inspect(bucket, store_dir, capsys):
    assert exit_status(["upload", str(store_dir), f"s3://{bucket}/cli/toy"]) == 0
    out = capsys.readouterr().out
    assert f"to s3://{bucket}/cli/toy" in out and "checksum matches meta.json" in out
    assert exit_status(["inspect", f"s3://{bucket}/cli/toy"]) == 0
    assert '"dataset": "s3-toy"' in capsys.readouterr().out


def test_corrupt_object_is_detected_and_nothing_is_cached(bucket, store_dir, tmp_path, capsys):
    url = f"s3://{bucket}/toy"
    upload_store(store_dir, url)
    client = boto3.client("s3")
    data = bytearray((store_dir / "part-1/labels.npy").read_bytes())
    data[-1] ^= 0x01  # one bit, same length: only the checksum can tell
    client.put_object(Bucket=bucket, Key="toy/part-1/labels.npy", Body=bytes(data))
    assert exit_status(["inspect", url]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert f"partition store {url}: part 1 as downloaded does not match meta.json, nothing cached" in err
    assert "part-1/labels.npy is corrupt" in err
    assert cache_entries(tmp_path) == []
    # Part 0 alone is intact and can still be fetched; the corrupt part never enters the cache.
    root = fetch_store(url, parts=[0])
    with pytest.raises(StoreError, match="part 1 as downloaded does not match"):
        fetch_store(url)
    assert sorted(p.name for p in root.iterdir()) == ["meta.json", "part-0"]
    assert cache_entries(tmp_path) == [root.name]


def test_upload_detects_a_checksum_s3_does_not_confirm(bucket, store_dir, monkeypatch):
    """If what S3 stored does not have the checksum computed here, the upload fails naming it."""
    from dorylus.partition import s3

    real = s3._checksums

    def off_by_one_for_labels(path, *args):
        sha, expected, parts = real(path, *args)
        if path.name == "labels.npy":
            expected = "A" + expected[1:] if expected[0] != "A" else "B" + expected[1:]
        return sha, expected, parts

    monkeypatch.setattr(s3, "_checksums", off_by_one_for_labels)
    with pytest.raises(StoreError, match=rf"s3://{bucket}/toy/part-0/labels.npy: S3 holds \d+ bytes with SHA-256 "
                                         r"checksum .* run dorylus upload again"):
        upload_store(store_dir, f"s3://{bucket}/toy")


@pytest.mark.parametrize("url", ["s3:/bucket/p", "https://bucket/p", "s3://", "s3://Bad_Bucket/p",
                                 "s3://bucket/a/../b", "s3://bucket/a//b"])
def test_bad_urls_are_refused(url):
    with pytest.raises(ConfigError, match="s3://BUCKET/PREFIX|segments"):
        parse_s3_url(url)


def test_cli_bad_input_exits_2(bucket, store_dir, tmp_path, capsys):
    (tmp_path / "not-a-store").mkdir()
    cases = [
        (["upload", str(tmp_path / "missing"), f"s3://{bucket}/x"], f"partition store {tmp_path / 'missing'} does not exist"),
        (["upload", str(tmp_path / "not-a-store"), f"s3://{bucket}/x"], "has no meta.json (not a partition store?)"),
        (["upload", str(store_dir), "s3:/oops"], "s3:/oops: not an S3 store URL"),
        (["upload", str(store_dir), "s3://no-such-bucket-here/x"], "s3://no-such-bucket-here: no such bucket (or no access to it)"),
        (["inspect", f"s3://{bucket}/nothing-here"], f"reading s3://{bucket}/nothing-here/meta.json: no such object"),
    ]
    for argv, message in cases:
        assert exit_status(argv) == 2, argv
        err = capsys.readouterr().err.strip()
        assert message in err and len(err.splitlines()) == 1, (argv, err)


def test_a_sparse_features_store_round_trips(bucket, tmp_path):
    """A store with CSR features (format version 2) uploads and fetches its features_* files."""
    rng = np.random.default_rng(1)
    n, f = 200, 50
    masks = rng.random(n)
    dataset = GraphDataset(
        name="s3-sparse", src=rng.integers(0, n, 600), dst=rng.integers(0, n, 600),
        features=np.where(rng.random((n, f)) < 0.03, 1.0, 0.0).astype(np.float32), labels=rng.integers(0, 4, n),
        train_mask=masks < 0.3, val_mask=(masks >= 0.3) & (masks < 0.5), test_mask=masks >= 0.5, num_classes=4)
    write_store(dataset, (np.arange(n) >= 120).astype(np.int64), tmp_path / "sparse", method="contiguous", seed=0)
    original = open_store(tmp_path / "sparse")
    assert original.meta.feature_layout(1) == "csr"
    uploaded = upload_store(tmp_path / "sparse", f"s3://{bucket}/sparse")
    assert uploaded.files == len(original.meta.files) + 1
    root = fetch_store(f"s3://{bucket}/sparse", parts=[1])
    assert sorted(p.name for p in (root / "part-1").iterdir()) == sorted(
        rel.split("/")[1] for rel in original.meta.part_files(1))
    fetched = open_store(root, verify=False).load_part(1)
    # owned vertices are in the store's locality order, not ascending
    np.testing.assert_array_equal(fetched.features.toarray(), dataset.features[fetched.owned])
    assert sorted(fetched.owned) == list(range(120, n))


def test_install_keeps_what_another_process_installed_first(tmp_path):
    """Two graph servers on one machine fetch into one cache entry: the whole entry goes in if it
    is new, else part by part, and a part already there is kept, never swapped under a reader."""
    from dorylus.partition.s3 import _install

    root = tmp_path / "entry"
    first = tmp_path / "first"
    (first / "part-0").mkdir(parents=True)
    (first / "part-0" / "x.npy").write_text("first")
    _install(first, root, [0])
    assert not first.exists() and (root / "part-0" / "x.npy").read_text() == "first"
    second = tmp_path / "second"
    for i in (0, 1):
        (second / f"part-{i}").mkdir(parents=True)
        (second / f"part-{i}" / "x.npy").write_text("second")
    _install(second, root, [0, 1])
    assert (root / "part-0" / "x.npy").read_text() == "first"  # kept
    assert (root / "part-1" / "x.npy").read_text() == "second"  # joined
    assert sorted(p.name for p in root.iterdir()) == ["part-0", "part-1"]
