"""Whether an object-store location (`gs://bucket/...`) answers, found out within a deadline.

A run whose workdir or data sit in a bucket must fail at once, naming the
bucket, when the bucket cannot be used: offline, gcsfs retries for well
over a minute before it gives up, and
without the `gcs` extra fsspec cannot open gs:// at all. `uri_problem`
asks the bucket once, in a daemon thread, and gives up after
STORAGE_TIMEOUT_S; the message says what to do. A URI is never turned into
a local path here or anywhere else (jrope.data.files.resolved).
"""

from __future__ import annotations

import threading
from urllib.parse import urlsplit

from etils import epath

# How long a bucket may take to answer before the run is stopped.
STORAGE_TIMEOUT_S = 30.0
# URI schemes etils.epath reads and writes (through fsspec: gcsfs, s3fs, adlfs).
SUPPORTED_SCHEMES = ("gs", "s3", "az")
# The extra that installs each scheme's filesystem.
_EXTRAS = {"gs": "pip install 'jrope[gcs]' (or: pip install gcsfs)"}


def uri_problem(
    uri: str, what: str, *, must_exist: bool = False, timeout_s: float = STORAGE_TIMEOUT_S
) -> str | None:
    """Why `uri` cannot be used (None: its bucket answered), e.g. for what='--workdir'.

    must_exist: the object or folder itself must be there (data), not only its bucket.
    """
    parts = urlsplit(uri)
    bucket = f"{parts.scheme}://{parts.netloc}"
    if parts.scheme not in SUPPORTED_SCHEMES or not parts.netloc:
        return (
            f"{what} {uri}: not a local path and not a bucket URI jrope can use "
            f"({', '.join(s + '://bucket/...' for s in SUPPORTED_SCHEMES)}); fix the path."
        )
    target = uri if must_exist else bucket
    answer: dict = {}

    def ask() -> None:
        try:
            answer["exists"] = epath.Path(target).exists()
        except BaseException as error:  # noqa: BLE001  (any failure is reported, named)
            answer["error"] = error

    thread = threading.Thread(target=ask, name=f"probe {bucket}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        return (
            f"{what} {uri}: bucket {bucket} did not answer within {timeout_s:g} s; check the "
            "network and the credentials (gcloud auth application-default login), or use a "
            "local path."
        )
    error = answer.get("error")
    if isinstance(error, ImportError):
        install = _EXTRAS.get(parts.scheme, f"install fsspec's {parts.scheme} filesystem")
        return f"{what} {uri}: reading {parts.scheme}:// needs its filesystem: {install}."
    if error is not None:
        cause = (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
        return (
            f"{what} {uri}: cannot reach bucket {bucket} ({type(error).__name__}: {cause}); "
            "check the bucket name, the network and the credentials."
        )
    if not answer["exists"]:
        if must_exist:
            return f"{what} {uri} does not exist in bucket {bucket}; fix the path."
        return (
            f"{what} {uri}: bucket {bucket} does not exist or these credentials cannot see it; "
            f"create it (gcloud storage buckets create {bucket}) or fix the name."
        )
    return None
