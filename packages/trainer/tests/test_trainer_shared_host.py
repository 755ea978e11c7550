"""The start-up warning about other people's processes on the host (a fake /proc listing)."""

from __future__ import annotations

from rlwire.trainer.driver import shared_host_warnings


def _status(name: str, uid: int | str) -> str:
    return (
        f"Name:\t{name}\nState:\tS (sleeping)\nUid:\t{uid}\t{uid}\t{uid}\t{uid}\nGid:\t0\t0\t0\t0\n"
    )


def test_other_login_users_are_named_once_with_the_docs_page():
    statuses = [
        _status("python", 1000),  # this run's user
        _status("sshd", 0),
        _status("systemd-resolve", 101),
        _status("nobody-daemon", 65534),
        _status("bash", 1002),
        _status("vim", 1001),
        _status("bash", 1002),
    ]
    assert shared_host_warnings(1000, statuses) == [
        "other users' processes run on this host (uid 1001, 1002): a local user can reach the "
        "run's torch rendezvous store and process-group connections, which are not "
        "authenticated; run on a host or network namespace of its own "
        "(docs/packages/ckpt-engine-failures.md#threat-model-a-shared-host)"
    ]
    many = [_status("bash", uid) for uid in range(2000, 2010)]
    [line] = shared_host_warnings(0, many)
    assert "(uid 2000, 2001, 2002, 2003, 2004, ...)" in line


def test_a_host_of_its_own_gives_none_and_a_bad_listing_never_raises():
    assert shared_host_warnings(1000, [_status("python", 1000), _status("sshd", 0)]) == []
    assert shared_host_warnings(0, []) == []  # no /proc
    malformed = ["", "Uid:", "Uid:\tx\t1001", "Name:\tno uid line\n", "\0\xff"]
    assert shared_host_warnings(1000, malformed) == []
    [line] = shared_host_warnings(1000, [*malformed, _status("bash", 1003)])  # skipped, not all
    assert "(uid 1003)" in line

    def failing():
        yield _status("bash", 1001)
        raise PermissionError("/proc/42/status")

    [line] = shared_host_warnings(1000, failing())  # never raises; keeps what it read
    assert "(uid 1001)" in line


def test_the_real_reader_yields_status_texts():
    from rlwire.trainer.driver import proc_statuses

    texts = list(proc_statuses())
    assert texts and all("Uid:" in t for t in texts[:5])
