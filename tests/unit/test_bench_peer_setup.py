"""What `python -m bench peers` installs for the peers, and which it skips, on a given machine
(bench/peer_setup.py): decided without running anything."""

from __future__ import annotations

from bench.peer_setup import NEEDS, Machine, bench_extra, plan

SYSTEMS = ["chimes", "procrastinate", "pgqueuer", "celery"]
EXTRA = bench_extra()  # the real pyproject.toml's
EVERYTHING = frozenset(name for needs in NEEDS.values() for name in needs.check)


def machine(installed: frozenset[str] = frozenset(), *, pip: bool = True, redis_server: bool = False,
            root: bool = True, apt_get: bool = True) -> Machine:
    return Machine(installed, pip, redis_server, root, apt_get)


def test_the_extra_names_every_package_a_peer_installs() -> None:
    assert {name for needs in NEEDS.values() for name in needs.install} <= set(EXTRA)
    assert EXTRA["celery"].startswith("celery[redis]")  # the redis client Celery's broker needs comes with it


def test_a_fresh_machine_as_root_installs_everything_and_skips_nothing() -> None:
    found = plan(SYSTEMS, machine(), EXTRA)
    assert found.skips == {}
    assert found.pip == [EXTRA[n] for n in ("procrastinate", "psycopg", "pgqueuer", "celery")]
    assert found.apt == ["redis-server"]
    assert found.runs(SYSTEMS) == SYSTEMS


def test_a_ready_machine_installs_nothing() -> None:
    found = plan(SYSTEMS, machine(EVERYTHING, redis_server=True, root=False, apt_get=False), EXTRA)
    assert (found.pip, found.apt, found.skips) == ([], [], {})


def test_without_root_celery_is_skipped_with_the_command_and_the_rest_still_installed() -> None:
    found = plan(SYSTEMS, machine(root=False), EXTRA)
    assert list(found.skips) == ["celery"]
    assert "needs root: sudo apt-get install -y redis-server" in found.skips["celery"]
    assert found.apt == [] and EXTRA["celery"] not in found.pip  # nothing installed for a skipped peer
    assert EXTRA["pgqueuer"] in found.pip
    assert found.runs(SYSTEMS) == ["chimes", "procrastinate", "pgqueuer"]


def test_without_apt_get_celery_is_skipped_even_as_root() -> None:
    found = plan(["chimes", "celery"], machine(EVERYTHING, apt_get=False), EXTRA)
    assert found.skips == {"celery": "redis-server (its broker) is not installed and there is no apt-get to "
                                      "install it"}


def test_without_pip_only_the_peers_already_installed_run() -> None:
    found = plan(SYSTEMS, machine(frozenset({"pgqueuer"}), pip=False, redis_server=True), EXTRA)
    assert found.runs(SYSTEMS) == ["chimes", "pgqueuer"]
    assert "no pip" in found.skips["procrastinate"]
    assert "celery, redis not installed" in found.skips["celery"]
    assert found.pip == [] and found.apt == []


def test_after_the_installs_what_is_still_missing_is_a_skip() -> None:
    # pip brought everything but procrastinate; apt-get could not install redis-server.
    after = machine(EVERYTHING - {"procrastinate"})
    found = plan(SYSTEMS, after, EXTRA, install=False)
    assert found.skips == {"procrastinate": "procrastinate could not be installed with pip",
                           "celery": "redis-server (its broker) could not be installed with apt-get"}
    assert (found.pip, found.apt) == ([], [])


def test_chimes_alone_needs_nothing() -> None:
    found = plan(["chimes"], machine(pip=False, root=False, apt_get=False), EXTRA)
    assert (found.pip, found.apt, found.skips) == ([], [], {})
