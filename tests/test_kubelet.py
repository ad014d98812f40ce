"""Kubernetes names of a workload from the kubelet's log directories: a fake kubelet tree per
container runtime and cgroup driver, and hostile entries (odd names, missing or huge directories)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from aiprobe.containers import Workload, workload_of
from aiprobe.kubelet import KubeletLogs

CID = "3f2a9c1d0e4b" + "a" * 52
UID = "1234abcd-1234-5678-9abc-def012345678"
UID_SYSTEMD = UID.replace("-", "_")


def kubelet_tree(root: Path, namespace: str, pod: str, uid: str, container: str, container_id: str) -> KubeletLogs:
    """/var/log/pods and /var/log/containers as the kubelet lays them out for one container."""
    pods, containers = root / "pods", root / "containers"
    log = pods / f"{namespace}_{pod}_{uid}" / container / "0.log"
    log.parent.mkdir(parents=True)
    log.write_text("")
    containers.mkdir(exist_ok=True)
    (containers / f"{pod}_{namespace}_{container}-{container_id}.log").symlink_to(log)
    return KubeletLogs(pods, containers, min_rescan_seconds=0.0)


@pytest.mark.parametrize("path", [
    # containerd, systemd driver
    f"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID_SYSTEMD}.slice/cri-containerd-{CID}.scope",
    # CRI-O, systemd driver: the container and its conmon
    f"/kubepods.slice/kubepods-pod{UID_SYSTEMD}.slice/crio-{CID}.scope",
    f"/kubepods.slice/kubepods-pod{UID_SYSTEMD}.slice/crio-conmon-{CID}.scope",
    # Docker (cri-dockerd), systemd driver
    f"/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{UID_SYSTEMD}.slice/docker-{CID}.scope",
    # cgroupfs driver (containerd, CRI-O, Docker): the bare id
    f"/kubepods/burstable/pod{UID}/{CID}",
])
def test_each_runtimes_cgroup_gets_its_pod_namespace_and_container_name(tmp_path: Path, path: str) -> None:
    kubelet = kubelet_tree(tmp_path, "inference", "llm-server-7d9f-x2k4q", UID, "vllm", CID)
    named = kubelet.named(workload_of(path))
    assert (named.namespace, named.pod, named.container, named.container_id, named.pod_uid) == \
        ("inference", "llm-server-7d9f-x2k4q", "vllm", CID, UID)
    assert kubelet.named(workload_of(path)) == named  # from the cache


def test_names_of_a_pod_with_dots_and_of_one_of_several_containers(tmp_path: Path) -> None:
    kubelet = kubelet_tree(tmp_path, "kube-system", "coredns.v1-0", UID, "coredns", CID)
    other = "b" * 64
    (tmp_path / "containers" / f"coredns.v1-0_kube-system_sidecar-{other}.log").symlink_to("nowhere")
    sidecar = kubelet.named(workload_of(f"/kubepods/pod{UID}/{other}"))
    main = kubelet.named(workload_of(f"/kubepods/pod{UID}/{CID}"))
    assert [(w.namespace, w.pod, w.container) for w in (main, sidecar)] == \
        [("kube-system", "coredns.v1-0", "coredns"), ("kube-system", "coredns.v1-0", "sidecar")]


def test_a_container_without_a_log_keeps_its_short_id_in_its_named_pod(tmp_path: Path) -> None:
    """A pod's sandbox (pause) container has no log: its pod is named, its container is its id."""
    kubelet = kubelet_tree(tmp_path, "ns", "pod", UID, "app", CID)
    sandbox = kubelet.named(workload_of(f"/kubepods/pod{UID}/{'c' * 64}"))
    assert (sandbox.namespace, sandbox.pod, sandbox.container) == ("ns", "pod", "c" * 12)


def test_host_processes_and_plain_containers_have_no_pod(tmp_path: Path) -> None:
    kubelet = kubelet_tree(tmp_path, "ns", "pod", UID, "app", CID)
    for path, container in (("/user.slice/user-1000.slice/session-2.scope", "host"),
                            (f"/system.slice/docker-{CID}.scope", CID[:12]), ("/", "host")):
        named = kubelet.named(workload_of(path))
        assert (named.namespace, named.pod, named.container) == ("", "", container)


def test_outside_kubernetes_pod_shaped_cgroups_keep_their_ids(tmp_path: Path) -> None:
    kubelet = KubeletLogs(tmp_path / "no-pods", tmp_path / "no-containers", min_rescan_seconds=0.0)
    named = kubelet.named(workload_of(f"/kubepods/pod{UID}/{CID}"))
    assert (named.namespace, named.pod, named.container, named.pod_uid) == ("", "", CID[:12], UID)


def test_a_new_pod_is_found_on_a_miss_at_most_once_per_interval(tmp_path: Path) -> None:
    (tmp_path / "pods").mkdir()
    (tmp_path / "containers").mkdir()
    patient, eager = (KubeletLogs(tmp_path / "pods", tmp_path / "containers", min_rescan_seconds=seconds)
                      for seconds in (3600.0, 0.0))
    workload = workload_of(f"/kubepods/pod{UID}/{CID}")
    assert patient.named(workload).pod == eager.named(workload).pod == ""  # read the empty directories
    kubelet_tree(tmp_path, "ns", "late", UID, "app", CID)
    assert patient.named(workload).pod == ""  # its next miss waits for the interval
    assert eager.named(workload).pod == "late"


HOSTILE_POD_DIRECTORIES = [
    b"ns_pod_with_extra_" + UID.encode(),  # '_' is in no namespace or pod name: not the kubelet's
    b"ns__" + UID.encode(),  # no pod name
    b"NS_Pod_" + UID.encode(),  # capitals: no DNS name
    b"ns_pod_" + UID.encode() + b"x",  # no uid
    b"ns_p\xffod_" + UID.encode(),  # not UTF-8
    b"ns_pod\n_" + UID.encode(),
    b"-ns_pod_" + UID.encode(),
    b"x" * 180,  # the longest a link to it may be
]


@pytest.mark.parametrize("name", HOSTILE_POD_DIRECTORIES, ids=range(len(HOSTILE_POD_DIRECTORIES)))
def test_names_not_the_kubelets_name_nothing(tmp_path: Path, name: bytes) -> None:
    pods, containers = tmp_path / "pods", tmp_path / "containers"
    os.makedirs(os.fsencode(pods) + b"/" + name)
    containers.mkdir()
    container_link = name.replace(UID.encode(), b"") + b"_app-" + CID.encode() + b".log"
    os.symlink(b"/", os.fsencode(containers) + b"/" + container_link)
    named = KubeletLogs(pods, containers, min_rescan_seconds=0.0).named(workload_of(f"/kubepods/pod{UID}/{CID}"))
    assert (named.namespace, named.pod, named.container) == ("", "", CID[:12])


def test_a_container_link_disagreeing_with_its_pods_directory_names_no_container(tmp_path: Path) -> None:
    kubelet = kubelet_tree(tmp_path, "ns", "pod", UID, "app", CID)
    other = "d" * 64
    (tmp_path / "containers" / f"impostor_ns_evil-{other}.log").symlink_to("nowhere")
    named = kubelet.named(workload_of(f"/kubepods/pod{UID}/{other}"))
    assert (named.namespace, named.pod, named.container) == ("ns", "pod", other[:12])


def test_missing_unreadable_or_huge_directories_degrade_to_no_names(tmp_path: Path) -> None:
    workload = workload_of(f"/kubepods/pod{UID}/{CID}")
    (tmp_path / "file").write_text("not a directory")
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    for pods, containers in ((tmp_path / "file", tmp_path / "file"), (tmp_path / "loop", tmp_path / "loop")):
        named = KubeletLogs(pods, containers, min_rescan_seconds=0.0).named(workload)
        assert (named.namespace, named.pod, named.container) == ("", "", CID[:12])
    huge = tmp_path / "huge"
    kubelet_tree(huge, "ns", "pod", UID, "app", CID)
    for index in range(50):
        (huge / "pods" / f"ns_filler{index}_{UID[:-4]}{index:04x}").mkdir()
    bounded = KubeletLogs(huge / "pods", huge / "containers", min_rescan_seconds=0.0, max_entries=10)
    bounded.named(workload)  # reads 10 entries of 51, whichever they are
    assert len(bounded._pods) <= 10


def test_a_workload_labels_a_record() -> None:
    class Record:
        container = namespace = pod = ""

    record = Record()
    Workload("/", CID, UID, "ns", "pod", "app").label(record)
    assert (record.container, record.namespace, record.pod) == ("app", "ns", "pod")
