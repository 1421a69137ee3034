"""The one line a failed read or write is reported with: an OS error by its errno name, its
text and the file or files it names, whether the error object is at hand or only its text."""

import errno
import os

import pytest

from megatron.training.checkpointing import describe_error

ENOENT = os.strerror(errno.ENOENT)


def test_an_error_naming_two_files_names_both():
    # How CPython builds what os.rename, os.replace and os.link raise.
    error = OSError(errno.ENOENT, ENOENT, "a", None, "b")
    assert describe_error(error) == f"ENOENT ({ENOENT}) on a -> b"


def test_a_failed_rename_names_both_folders(tmp_path):
    old, new = tmp_path / "iter_0000009", tmp_path / "iter_0000009.discarded-x"
    with pytest.raises(OSError) as raised:
        os.rename(old, new)
    assert describe_error(raised.value) == f"ENOENT ({ENOENT}) on {old} -> {new}"


@pytest.mark.parametrize("error, line", [
    (OSError(errno.ENOENT, ENOENT, "a", None, "b"), f"ENOENT ({ENOENT}) on a -> b"),
    (OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "/c/it's"),
     f"ENOSPC ({os.strerror(errno.ENOSPC)}) on /c/it's"),
    (OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)), f"ENOSPC ({os.strerror(errno.ENOSPC)})"),
])
def test_the_same_line_from_an_error_known_only_by_its_text(error, line):
    # A writer's failure that reached rank 0 as text inside another exception.
    assert describe_error(RuntimeError(f"write failed: {error}")) == line
    assert describe_error(error) == line


def test_an_error_text_quoted_inside_another_is_read_to_its_closing_quote():
    text = f"[Errno {errno.ENOENT}] {ENOENT}: 'a' -> 'b'"
    assert describe_error(RuntimeError(f"failures: [{text!r}]")) == f"ENOENT ({ENOENT}) on a -> b"
