"""Where images' bytes live: one small key/value interface over a directory or an S3-compatible bucket.

Keys are ``/``-separated relative paths (``chunks/sha256/ab/<hex>``, ``manifests/...``, ``tags/<name>``).
:class:`DirStore` serves both the local default and any shared POSIX mount (NFS, JuiceFS, 3FS, CephFS):
every write goes to a unique temporary file in the target directory, is fsynced, then renamed into place,
so concurrent writers on several nodes never expose a partial object. :class:`S3Store` speaks S3 through
boto3. Store failures are raised as :class:`~dsec.errors.StoreUnavailable`; a missing key as ``KeyError``.
This module never interprets the bytes it moves (verification is the caller's job).
"""

from __future__ import annotations

import abc
import contextlib
import os
import secrets
import threading
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from dsec.errors import InvalidRequest, StoreUnavailable

__all__ = ["DEFAULT_S3_TIMEOUT", "BlobStore", "DirStore", "S3Store", "ThrottledStore", "open_store"]


def _check_key(key: str) -> str:
    parts = key.split("/")
    if not key or key.startswith("/") or any(p in ("", ".", "..") for p in parts) or "\0" in key:
        raise InvalidRequest(f"invalid store key {key!r}")
    return key


class BlobStore(abc.ABC):
    """Immutable-ish objects by key. Every method is safe to call from several threads and processes."""

    url: str

    @abc.abstractmethod
    def get(self, key: str) -> bytes:
        """The object's bytes; ``KeyError`` when absent, :class:`StoreUnavailable` when unreachable."""

    @abc.abstractmethod
    def put(self, key: str, data: bytes) -> None:
        """Create or replace the object atomically (readers see the old or the new bytes, never a mix)."""

    @abc.abstractmethod
    def has(self, key: str) -> bool:
        """True when the object exists."""

    @abc.abstractmethod
    def delete(self, key: str) -> None:
        """Remove the object (no error when absent)."""

    @abc.abstractmethod
    def keys(self, prefix: str) -> Iterator[tuple[str, int, float]]:
        """``(key, size, modified)`` of every object under directory ``prefix`` (e.g. ``"chunks/"``)."""


class DirStore(BlobStore):
    """Objects as files under ``root`` (local disk or a shared POSIX mount)."""

    def __init__(self, root: Path | str) -> None:
        self.root = Path(root)
        self.url = f"file://{self.root}"

    def _path(self, key: str) -> Path:
        return self.root / _check_key(key)

    def get(self, key: str) -> bytes:
        try:
            return self._path(key).read_bytes()
        except (FileNotFoundError, NotADirectoryError):
            raise KeyError(key) from None
        except OSError as exc:
            raise StoreUnavailable(f"image store {self.url}: reading {key} failed: {exc}", key=key) from exc

    def put(self, key: str, data: bytes) -> None:
        path = self._path(key)
        tmp = path.parent / f".tmp-{path.name}-{secrets.token_hex(6)}"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
                os.fsync(fd)
            finally:
                os.close(fd)
            os.rename(tmp, path)
        except OSError as exc:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise StoreUnavailable(f"image store {self.url}: writing {key} failed: {exc}", key=key) from exc

    def has(self, key: str) -> bool:
        return self._path(key).is_file()

    def delete(self, key: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self._path(key).unlink()

    def keys(self, prefix: str) -> Iterator[tuple[str, int, float]]:
        base = self.root / prefix.rstrip("/") if prefix else self.root
        if not base.is_dir():
            return
        for dirpath, _dirs, files in os.walk(base):
            for name in files:
                if name.startswith(".tmp-"):
                    continue
                full = os.path.join(dirpath, name)
                try:
                    st = os.stat(full)
                except FileNotFoundError:
                    continue
                yield os.path.relpath(full, self.root), st.st_size, st.st_mtime


DEFAULT_S3_TIMEOUT = 10.0
"""Seconds an S3 store's connect and each read may take (``timeout=`` in its URL), per attempt."""


class S3Store(BlobStore):
    """Objects in an S3-compatible bucket (AWS, SeaweedFS, MinIO, Ceph RGW) under an optional prefix."""

    def __init__(self, bucket: str, prefix: str = "", endpoint_url: str | None = None,
                 region: str | None = None, timeout: float = DEFAULT_S3_TIMEOUT, retries: int = 2) -> None:
        import boto3
        from botocore.config import Config

        self.bucket = bucket
        self.prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""
        # The whole configuration: the lazy server process opens the store again from this URL.
        given = (("endpoint", endpoint_url), ("region", region),
                 ("timeout", None if timeout == DEFAULT_S3_TIMEOUT else f"{timeout:g}"))
        query = urllib.parse.urlencode({k: v for k, v in given if v}, safe=":/")
        self.url = f"s3://{bucket}/{self.prefix}" + (f"?{query}" if query else "")
        self.region = region or "us-east-1"
        config = Config(connect_timeout=timeout, read_timeout=timeout, retries={"max_attempts": retries},
                        max_pool_connections=32)
        self._s3: Any = boto3.client("s3", endpoint_url=endpoint_url, region_name=self.region, config=config)

    def _fail(self, what: str, key: str, exc: Exception) -> StoreUnavailable:
        return StoreUnavailable(f"image store {self.url}: {what} {key} failed: {type(exc).__name__}: {exc}",
                                key=key)

    def get(self, key: str) -> bytes:
        from botocore.exceptions import ClientError

        try:
            body = self._s3.get_object(Bucket=self.bucket, Key=self.prefix + _check_key(key))["Body"]
            data: bytes = body.read()
            return data
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
                raise KeyError(key) from None
            raise self._fail("reading", key, exc) from exc
        except Exception as exc:
            raise self._fail("reading", key, exc) from exc

    def put(self, key: str, data: bytes) -> None:
        try:
            self._s3.put_object(Bucket=self.bucket, Key=self.prefix + _check_key(key), Body=data)
        except Exception as exc:
            raise self._fail("writing", key, exc) from exc

    def has(self, key: str) -> bool:
        from botocore.exceptions import ClientError

        try:
            self._s3.head_object(Bucket=self.bucket, Key=self.prefix + _check_key(key))
            return True
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("NoSuchKey", "404", "NotFound"):
                return False
            raise self._fail("checking", key, exc) from exc
        except Exception as exc:
            raise self._fail("checking", key, exc) from exc

    def delete(self, key: str) -> None:
        try:
            self._s3.delete_object(Bucket=self.bucket, Key=self.prefix + _check_key(key))
        except Exception as exc:
            raise self._fail("deleting", key, exc) from exc

    def keys(self, prefix: str) -> Iterator[tuple[str, int, float]]:
        try:
            pages = self._s3.get_paginator("list_objects_v2").paginate(Bucket=self.bucket,
                                                                       Prefix=self.prefix + prefix)
            for page in pages:
                for obj in page.get("Contents", []):
                    yield obj["Key"][len(self.prefix):], int(obj["Size"]), obj["LastModified"].timestamp()
        except Exception as exc:
            raise self._fail("listing", prefix, exc) from exc

    def ensure_bucket(self) -> None:
        """Create the bucket if it does not exist (tests and first use)."""
        try:
            self._s3.head_bucket(Bucket=self.bucket)
        except Exception:
            try:
                self._s3.create_bucket(Bucket=self.bucket)
            except Exception as exc:
                raise self._fail("creating bucket", self.bucket, exc) from exc


class ThrottledStore(BlobStore):
    """Another store behind an emulated network link: a per-request latency and a shared byte rate.

    For benchmarks (``dsec bench images``): a directory store on this machine made to behave like a
    remote one, reproducibly. Reads are throttled; writes, listings and deletes are not.
    """

    def __init__(self, inner: BlobStore, rate: float, latency: float) -> None:
        if rate <= 0 or latency < 0:
            raise InvalidRequest(f"throttle needs rate > 0 and latency >= 0, got rate={rate} latency={latency}")
        self.inner, self.rate, self.latency = inner, rate, latency
        self.url = f"{inner.url}?rate={rate:.0f}&latency={latency:.6f}"
        self._lock = threading.Lock()
        self._link_free_at = 0.0

    def get(self, key: str) -> bytes:
        data = self.inner.get(key)
        with self._lock:  # one link shared by every thread: transfers queue behind each other
            start = max(time.monotonic(), self._link_free_at)
            self._link_free_at = start + len(data) / self.rate
            done = self._link_free_at + self.latency
        time.sleep(max(0.0, done - time.monotonic()))
        return data

    def put(self, key: str, data: bytes) -> None:
        self.inner.put(key, data)

    def has(self, key: str) -> bool:
        return self.inner.has(key)

    def delete(self, key: str) -> None:
        self.inner.delete(key)

    def keys(self, prefix: str) -> Iterator[tuple[str, int, float]]:
        return self.inner.keys(prefix)


def open_store(url: str) -> BlobStore:
    """A store from a URL: a path or ``file:///path``, or ``s3://bucket/prefix?endpoint=http://host:port``.

    S3 credentials come from boto3's usual sources (``AWS_ACCESS_KEY_ID``... or its config files); an S3 URL
    may also carry ``region=`` and ``timeout=SECONDS`` (connect and read, per attempt; default
    :data:`DEFAULT_S3_TIMEOUT`). A path may carry ``?rate=BYTES_PER_S&latency=SECONDS`` to emulate a remote link
    (:class:`ThrottledStore`).
    """
    if url.startswith("s3://"):
        parsed = urllib.parse.urlsplit(url)
        if not parsed.netloc:
            raise InvalidRequest(f"image store URL {url!r} names no bucket (s3://BUCKET/PREFIX?endpoint=URL)")
        query = urllib.parse.parse_qs(parsed.query)
        endpoint = query.get("endpoint", [None])[0]
        region = query.get("region", [None])[0]
        return S3Store(parsed.netloc, parsed.path, endpoint_url=endpoint, region=region,
                       timeout=_s3_timeout(url, query.get("timeout", [None])[0]))
    if url.startswith("file://"):
        url = url[len("file://"):]
    path, _, throttle = url.partition("?")
    if not path.startswith("/"):
        raise InvalidRequest(f"image store URL {url!r}: use an absolute path, file:///path or s3://bucket/prefix")
    store: BlobStore = DirStore(path)
    if throttle:
        params = urllib.parse.parse_qs(throttle)
        try:
            rate, latency = float(params["rate"][0]), float(params.get("latency", ["0"])[0])
        except (KeyError, ValueError):
            raise InvalidRequest(f"image store URL {url!r}: the query takes rate=BYTES_PER_S&latency=SECONDS") from None
        store = ThrottledStore(store, rate, latency)
    return store


def _s3_timeout(url: str, given: str | None) -> float:
    if given is None:
        return DEFAULT_S3_TIMEOUT
    try:
        seconds = float(given)
    except ValueError:
        seconds = 0.0
    if not 0 < seconds < 3600:
        raise InvalidRequest(f"image store URL {url!r}: timeout={given} is not a number of seconds between 0 and "
                             f"3600 (e.g. timeout=5)")
    return seconds
