"""Partition stores in S3 (DESIGN §6): ``dorylus upload`` and ``s3://`` store paths.

A store in S3 has the directory's layout under a prefix: ``s3://BUCKET/PREFIX/meta.json`` and
``.../part-<i>/<name>.npy``. Graph servers memory-map their part, which S3 cannot do, so an
``s3://`` path is fetched into a local cache first (:func:`fetch_store`) and opened from there.

Integrity end to end, without reading anything back over the network:

* upload: every file is sent with a SHA-256 checksum per request (per part for multipart), which
  S3 checks on receipt; afterwards the object's checksum as S3 stores it is compared with the
  one computed here from the file, whose whole-file sha256 must equal ``meta.json``'s. For a
  multipart object S3 keeps a checksum of the parts' checksums, so that is what is computed
  here for it, with the part size the transfer used. ``meta.json`` goes last: a reader never
  sees a store whose files are not all there.
* download: into a temp directory beside the cache entry, checked with the store's own
  :meth:`~dorylus.partition.store.PartitionStore.verify` against ``meta.json``, then renamed
  into place; a corrupt object leaves nothing behind.

The cache entry is named by the store's fingerprint (the sha256 of ``meta.json``, which holds
every file's sha256), so a re-uploaded store is fetched anew and never mixed with the old one,
and two graph servers on one machine share what they both need. ``AWS_ENDPOINT_URL_S3`` (which
boto3 honours) or ``endpoint_url`` points at another S3, such as moto's server in the tests.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

from dorylus.errors import ConfigError, StoreError
from dorylus import atomic
from dorylus.partition.store import META_FILE, PartitionStore, StoreMeta, open_dir

MiB = 1024 * 1024
# Part size and threshold for multipart transfers: big enough that a multi-GB feature file is a
# few hundred requests, small enough that a retry resends little.
PART_BYTES = 64 * MiB
_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")


def is_url(path: str | os.PathLike) -> bool:
    """Whether a store path names a store in S3 (``s3://...``) rather than a directory: the one
    test :func:`dorylus.partition.open_store`, :func:`~dorylus.partition.read_meta` and the
    cluster file's store path go by."""
    return isinstance(path, str) and path.startswith("s3://")


def parse_s3_url(url: str) -> tuple[str, str]:
    """``s3://BUCKET/PREFIX`` -> ``(bucket, prefix)``, the prefix without slashes at its ends."""
    match = re.fullmatch(r"s3://([^/]*)/?(.*)", str(url))
    if not match or not _BUCKET.fullmatch(match[1]):
        raise ConfigError(f"{url}: not an S3 store URL; expected s3://BUCKET/PREFIX with a valid bucket name")
    prefix = match[2].strip("/")
    if "//" in prefix or any(piece in (".", "..") for piece in prefix.split("/")):
        raise ConfigError(f"{url}: the prefix may not contain empty, '.' or '..' segments")
    return match[1], prefix


def _key(prefix: str, rel: str) -> str:
    return f"{prefix}/{rel}" if prefix else rel


def transfer_config(part_bytes: int = PART_BYTES):
    """boto3's transfer settings: multipart above ``part_bytes``, in parts of that size."""
    from boto3.s3.transfer import TransferConfig

    return TransferConfig(multipart_threshold=part_bytes, multipart_chunksize=part_bytes, max_concurrency=8)


def s3_client(endpoint_url: str | None = None):
    """An S3 client with botocore's standard retry mode; ``endpoint_url`` overrides AWS (and
    ``AWS_ENDPOINT_URL_S3``)."""
    import boto3
    from botocore.config import Config

    return boto3.client("s3", endpoint_url=endpoint_url or None,
                        config=Config(retries={"mode": "standard", "max_attempts": 8}))


@contextlib.contextmanager
def _s3_errors(what: str, missing: str = "no such object"):
    """Turns boto's exceptions into one-line :class:`StoreError` / :class:`ConfigError`;
    ``missing`` says what a 404 means."""
    from boto3.exceptions import Boto3Error
    from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError

    try:
        yield
    except NoCredentialsError:
        raise ConfigError(f"{what}: no AWS credentials (set AWS_PROFILE or AWS_ACCESS_KEY_ID, or run where an "
                          f"instance role provides them)") from None
    except ClientError as exc:
        error = exc.response.get("Error", {})
        code = error.get("Code", "?")
        if code in ("404", "NoSuchKey", "NotFound"):
            raise StoreError(f"{what}: {missing}") from None
        raise StoreError(f"{what}: S3 said {code}: {error.get('Message') or exc}") from None
    except (BotoCoreError, Boto3Error) as exc:  # Boto3Error: the transfer manager's, wrapping S3's answer
        text = str(exc)
        raise StoreError(f"{what}: {text[text.find('An error occurred'):] if 'An error occurred' in text else text}") \
            from None


# ----------------------------------------------------------------------------- upload


def _checksums(path: Path, size: int, threshold: int, part_bytes: int) -> tuple[str, str, int]:
    """One pass over ``path``: its sha256 (hex), the ChecksumSHA256 S3 will report for it (base64;
    for a multipart upload the sha256 of the parts' sha256 digests) and the number of parts."""
    whole = hashlib.sha256()
    parts: list[bytes] = []
    with open(path, "rb") as f:
        while chunk := f.read(part_bytes):
            whole.update(chunk)
            parts.append(hashlib.sha256(chunk).digest())
    if size < threshold:
        return whole.hexdigest(), base64.b64encode(whole.digest()).decode(), 1
    composite = hashlib.sha256(b"".join(parts)).digest()
    return whole.hexdigest(), base64.b64encode(composite).decode(), len(parts)


@dataclass(frozen=True)
class Uploaded:
    url: str
    files: int
    bytes: int


def upload_store(store_dir: str | os.PathLike, url: str, *, endpoint_url: str | None = None,
                 part_bytes: int = PART_BYTES, progress: Callable[[str], None] | None = None) -> Uploaded:
    """Upload the partition store at ``store_dir`` to ``url`` (``s3://BUCKET/PREFIX``).

    The store is verified first (a corrupt store is not uploaded); each object's checksum in S3
    is compared with the file's, whose sha256 must still be ``meta.json``'s. Raises
    :class:`StoreError` naming the object that does not match."""
    from s3transfer.utils import ChunksizeAdjuster

    bucket, prefix = parse_s3_url(url)
    url = f"s3://{bucket}/{prefix}" if prefix else f"s3://{bucket}"
    store = open_dir(store_dir, verify=True)
    client, transfer = s3_client(endpoint_url), transfer_config(part_bytes)
    with _s3_errors(f"s3://{bucket}", missing="no such bucket (or no access to it)"):
        client.head_bucket(Bucket=bucket)
    say = progress or (lambda message: None)
    total, count = 0, 0
    for part in [*range(store.num_parts), None]:
        names = [META_FILE] if part is None else store.meta.part_files(part)
        part_total = 0
        for rel in names:
            path = store.path / rel
            size = path.stat().st_size
            chunk = ChunksizeAdjuster().adjust_chunksize(transfer.multipart_chunksize, size)
            sha, expected, pieces = _checksums(path, size, transfer.multipart_threshold, chunk)
            if part is not None and sha != store.meta.files[rel]:
                raise StoreError(f"partition store {store.path}: {rel} changed after it was verified; not uploaded")
            key = _key(prefix, rel)
            with _s3_errors(f"uploading {path} to s3://{bucket}/{key}"):
                client.upload_file(str(path), bucket, key, Config=transfer,
                                   ExtraArgs={"ChecksumAlgorithm": "SHA256", "Metadata": {"sha256": sha}})
                head = client.head_object(Bucket=bucket, Key=key, ChecksumMode="ENABLED")
            # A multipart object's checksum reads "<base64>-<parts>" on AWS (moto leaves out the count).
            stored = str(head.get("ChecksumSHA256") or "")
            value, _, stored_parts = stored.partition("-")
            if value != expected or head.get("ContentLength") != size or stored_parts not in ("", str(pieces)):
                raise StoreError(f"s3://{bucket}/{key}: S3 holds {head.get('ContentLength')} bytes with SHA-256 "
                                 f"checksum {stored or 'none'}, expected {size} bytes and {expected}"
                                 f"{f'-{pieces}' if pieces > 1 else ''}; run dorylus upload again")
            part_total += size
        total, count = total + part_total, count + len(names)
        say(f"uploaded {'meta.json' if part is None else f'part-{part}'} ({part_total:,} bytes) to {url}")
    return Uploaded(url=url, files=count, bytes=total)


# ----------------------------------------------------------------------------- download


def store_cache_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    """Where fetched stores live: ``cache_dir``, else ``$DORYLUS_STORE_CACHE``, else
    ``<dorylus cache>/stores``."""
    if cache_dir:
        return Path(cache_dir)
    if os.environ.get("DORYLUS_STORE_CACHE"):
        return Path(os.environ["DORYLUS_STORE_CACHE"])
    from dorylus.packaging import cache_home

    return cache_home() / "stores"


def _read_meta(client, bucket: str, prefix: str, url: str) -> tuple[str, StoreMeta]:
    meta_url = f"s3://{bucket}/{_key(prefix, META_FILE)}"
    with _s3_errors(f"partition store {url}: reading {meta_url}"):
        raw = client.get_object(Bucket=bucket, Key=_key(prefix, META_FILE))["Body"].read()
    try:
        text = raw.decode()
    except UnicodeDecodeError:
        raise StoreError(f"{meta_url}: not UTF-8 text") from None
    return text, StoreMeta.from_json(text, meta_url)


def read_store_meta(url: str, *, endpoint_url: str | None = None) -> StoreMeta:
    """The checked ``meta.json`` of the store at ``url``, without downloading any part (a
    parameter server needs only the feature and class counts)."""
    bucket, prefix = parse_s3_url(url)
    return _read_meta(s3_client(endpoint_url), bucket, prefix, url)[1]


def fetch_store(url: str, *, parts: Iterable[int] | None = None, cache_dir: str | os.PathLike | None = None,
                endpoint_url: str | None = None, progress: Callable[[str], None] | None = None) -> Path:
    """Download the store at ``url`` (only ``parts``, default all) into the local cache and
    return the local store directory, ready for :func:`~dorylus.partition.store.open_dir`.

    Parts already in the cache entry are not downloaded again. Everything new is downloaded
    into a temp directory, verified against ``meta.json``, then renamed into place, so a
    failure (a corrupt object: :class:`StoreError` naming it) leaves the cache as it was."""
    bucket, prefix = parse_s3_url(url)
    client, transfer = s3_client(endpoint_url), transfer_config()
    say = progress or (lambda message: None)
    text, meta = _read_meta(client, bucket, prefix, url)
    wanted = list(range(meta.num_parts)) if parts is None else sorted({int(i) for i in parts})
    for i in wanted:
        if not 0 <= i < meta.num_parts:
            raise StoreError(f"partition store {url} has parts 0..{meta.num_parts - 1}, not part {i}")

    cache = store_cache_dir(cache_dir)
    root = cache / PartitionStore(cache, meta).fingerprint()[:32]
    missing = [i for i in wanted if not (root / f"part-{i}").is_dir()]
    if root.is_dir() and not missing:
        return root
    cache.mkdir(parents=True, exist_ok=True)
    tmp = atomic.temp_dir_beside(root, mode=0o700)
    try:
        (tmp / META_FILE).write_text(text)
        for i in missing:
            (tmp / f"part-{i}").mkdir()
            for rel in meta.part_files(i):
                with _s3_errors(f"partition store {url}: downloading {rel}"):
                    client.download_file(bucket, _key(prefix, rel), str(tmp / rel), Config=transfer)
            try:
                PartitionStore(tmp, meta).verify([i])
            except StoreError as exc:
                problem = str(exc).replace(f"partition store {tmp}: ", "")  # the temp path means nothing to a user
                raise StoreError(f"partition store {url}: part {i} as downloaded does not match meta.json, "
                                 f"nothing cached: {problem}") from None
            say(f"fetched part-{i} of {url}")
        _install(tmp, root, missing)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return root


def _install(tmp: Path, root: Path, parts: list[int]) -> None:
    """Move the verified download into the cache entry: the whole entry if it is new, else
    part by part. A part another process installed meanwhile is kept (it is the same bytes, and
    that process may be opening it), hence ``exclusive``: never moved aside, never replaced."""
    try:
        atomic.replace_dir(tmp, root, exclusive=True)
        return
    except FileExistsError:
        pass
    for i in parts:
        with contextlib.suppress(FileExistsError):
            atomic.replace_dir(tmp / f"part-{i}", root / f"part-{i}", exclusive=True)
