"""S3 as a role scoped to one key prefix may use it.

The node roles (infra/components/iam.py, policy rule 17) may list the bucket only with an
``s3:prefix`` inside the stack's prefix. AWS evaluates a condition on a key the request does
not carry as false, so a request with no prefix at all is refused: HeadBucket, which is
``s3:ListBucket`` with no prefix. pyarrow's ``S3FileSystem.create_dir(path, recursive=True)``
sends one before it writes the folder's marker ("When testing for existence of bucket ...:
ACCESS_DENIED during HeadBucket"), so Ray Train's run store, whose ``create_dir`` calls are
pyarrow's, fails on a scoped role at its first folder. Ray Data skips ``create_dir`` on S3 for
the same reason (ray.data.datasource.file_datasink).

`scoped` wraps a pyarrow S3 filesystem so that making a folder under a bucket writes nothing
and asks nothing (S3 has no folders: a key's "folders" exist while a key is under them);
every other call is pyarrow's own. Making a bucket (a path without a key) is still pyarrow's,
which refuses it (``allow_bucket_creation`` is off)."""

from __future__ import annotations

import pyarrow.fs as pafs


class PrefixScopedS3(pafs.FileSystemHandler):
    """pyarrow's S3 filesystem, less the bucket check of ``create_dir`` (the module's text)."""

    def __init__(self, fs: pafs.S3FileSystem):
        self.fs = fs

    def __eq__(self, other) -> bool:
        return isinstance(other, PrefixScopedS3) and self.fs.equals(other.fs)

    def __ne__(self, other) -> bool:
        return not self == other

    def get_type_name(self) -> str:
        return "s3-prefix-scoped"

    def normalize_path(self, path: str) -> str:
        return self.fs.normalize_path(path)

    def get_file_info(self, paths):
        return self.fs.get_file_info(paths)

    def get_file_info_selector(self, selector):
        return self.fs.get_file_info(selector)

    def create_dir(self, path: str, recursive: bool) -> None:
        if not path.strip("/").partition("/")[2]:
            self.fs.create_dir(path, recursive=recursive)   # a bucket: pyarrow's refusal

    def delete_dir(self, path: str) -> None:
        self.fs.delete_dir(path)

    def delete_dir_contents(self, path: str, missing_dir_ok: bool = False) -> None:
        self.fs.delete_dir_contents(path, missing_dir_ok=missing_dir_ok)

    def delete_root_dir_contents(self) -> None:
        self.fs.delete_dir_contents("/", accept_root_dir=True)

    def delete_file(self, path: str) -> None:
        self.fs.delete_file(path)

    def move(self, src: str, dest: str) -> None:
        self.fs.move(src, dest)

    def copy_file(self, src: str, dest: str) -> None:
        self.fs.copy_file(src, dest)

    def open_input_stream(self, path: str):
        return self.fs.open_input_stream(path)

    def open_input_file(self, path: str):
        return self.fs.open_input_file(path)

    def open_output_stream(self, path: str, metadata):
        return self.fs.open_output_stream(path, metadata=metadata)

    def open_append_stream(self, path: str, metadata):
        return self.fs.open_append_stream(path, metadata=metadata)


def scoped(fs: pafs.S3FileSystem) -> pafs.FileSystem:
    return pafs.PyFileSystem(PrefixScopedS3(fs))
