"""`make test`'s two pytest-xdist workers: which tests share a worker (tests/conftest.py)."""

import json
from types import SimpleNamespace

import pytest

from tests.conftest import group_for_xdist, read_groups, scope_of, xdist_group


def _item(nodeid: str, *fixtures: str):
    return SimpleNamespace(nodeid=nodeid, fixturenames=list(fixtures))


def test_cluster_tests_share_a_group_and_the_long_groups_go_first():
    items = [_item("tests/unit/test_cost.py::a"),
             _item("tests/workloads/test_serve.py::b"),
             _item("tests/workloads/test_serve.py::c", "ray_cluster"),
             _item("tests/cluster/test_ansible.py::d"),
             _item("tests/faults/test_train_faults.py::e", "tmp_path", "ray_cluster"),
             _item("tests/fakecloud/test_ray_up.py::f")]
    groups = group_for_xdist(items)
    assert groups == {"tests/unit/test_cost.py::a": "tests/unit/test_cost.py",
                      # Its module's other test needs no cluster: off the cluster's worker.
                      "tests/workloads/test_serve.py::b": "tests/workloads/test_serve.py",
                      "tests/workloads/test_serve.py::c": "cluster",
                      "tests/cluster/test_ansible.py::d": "tests/cluster/test_ansible.py",
                      "tests/faults/test_train_faults.py::e": "cluster",
                      "tests/fakecloud/test_ray_up.py::f": "fakecloud"}
    # The rehearsal, then the cluster's tests in their own order, then Ansible, then the rest.
    assert [i.nodeid[-1] for i in items] == ["f", "c", "e", "d", "a", "b"]


def test_a_module_without_the_cluster_is_its_own_group():
    assert xdist_group("tests/moto/test_chain.py", uses_cluster=False) == \
        "tests/moto/test_chain.py"
    assert xdist_group("tests/fakecloud/test_ray_up.py", uses_cluster=True) == "fakecloud"


def test_an_ungrouped_test_is_an_error_not_a_scope_of_its_own(tmp_path):
    # Both workers' files are read (they collect the same tests; either may be first).
    (tmp_path / "groups.gw0").write_text(json.dumps({"tests/a.py::x": "cluster"}))
    (tmp_path / "groups.gw1").write_text(json.dumps({"tests/b.py::y": "tests/b.py"}))
    groups = read_groups(tmp_path / "groups")
    assert scope_of(groups, "tests/a.py::x") == "cluster"
    assert scope_of(groups, "tests/b.py::y") == "tests/b.py"
    with pytest.raises(RuntimeError, match=r"tests/c\.py::z: in no test group"):
        scope_of(groups, "tests/c.py::z")
    with pytest.raises(RuntimeError, match="no worker wrote its test groups"):
        read_groups(tmp_path / "none" / "groups")
