"""The cached builds of Go components (scripts/testbin.sh, scripts/kueuebin.sh, scripts/kindbin.sh) and the pieces
of the kind node made here (scripts/kind-node/). The builds themselves take minutes to tens of minutes; what is
checked here without them: two builds started at once take turns (a stand-in `go` that records overlap), the node's
scripts pass shellcheck, the storage manifest is resolved from kind's Go source, and the restricted-oom switch
reads the capability bounding set. The node image itself is exercised by the kind e2e (tests/e2e/test_kind.py)."""

from __future__ import annotations

import os
import subprocess
import textwrap
from pathlib import Path

import pytest

from tests.delivery.conftest import ROOT

NODE = ROOT / "scripts" / "kind-node"


def stand_in_go(tmp_path: Path) -> Path:
    """A `go` that answers the calls testbin.sh and kueuebin.sh make, and fails if two builds overlap: each `go build`
    holds a marker file for a second and refuses to start while another's marker exists. A build writes a file per
    package (`-o DIR/`) or the one file named (`-o FILE`) and logs the packages to `builds`."""
    module = tmp_path / "module-src"
    (module / "config" / "default").mkdir(parents=True, exist_ok=True)
    (module / "config" / "default" / "kustomization.yaml").write_text("resources: []\n")
    (module / "go.mod").write_text("module k8s.io/kubernetes\n\ngo 1.26\n\nrequire go.etcd.io/etcd/server/v3 v3.7.0\n")
    bin_dir = tmp_path / "gobin"
    bin_dir.mkdir(exist_ok=True)
    go = bin_dir / "go"
    go.write_text(textwrap.dedent(f"""\
        #!/usr/bin/env bash
        set -euo pipefail
        case "$1" in
          get) exit 0 ;;
          mod) echo '{{"Dir": "{module}", "GoMod": "{module}/go.mod"}}' ;;
          build)
            marker="{tmp_path}/building"
            [[ ! -e "$marker" ]] || {{ echo "two builds at once" >&2; exit 1; }}
            touch "$marker"; sleep 1
            shift; out=""; pkgs=()
            while (($#)); do
              case "$1" in -o) out=$2; shift ;; -ldflags|-tags) shift ;; -*) ;; *) pkgs+=("$1") ;; esac
              shift
            done
            echo "${{pkgs[*]}}" >> "{tmp_path}/builds"
            if [[ $out == */ ]]; then for p in "${{pkgs[@]}}"; do echo binary > "$out${{p##*/}}"; done
            else echo binary > "$out"; fi
            chmod +x "$out"* 2>/dev/null || true
            rm "$marker" ;;
        esac
        """))
    go.chmod(0o755)
    return bin_dir


def run_at_once(script: Path, tmp_path: Path, *args: str, runs: int = 2) -> list[tuple[int, str, str]]:
    env = {**os.environ, "PATH": f"{stand_in_go(tmp_path)}:{os.environ['PATH']}",
           "PARATRAIN_TESTBIN_CACHE": str(tmp_path / "cache")}
    procs = [subprocess.Popen(["bash", str(script), *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(runs)]
    return [(proc.wait(timeout=120), *proc.communicate()) for proc in procs]


def test_two_kueue_builds_at_once_take_turns_and_build_once(tmp_path):
    """Two unlocked builds once raced on one temporary file (`mv: cannot stat '…/kueue.tmp'`) and failed a CI run."""
    results = run_at_once(ROOT / "scripts" / "kueuebin.sh", tmp_path)
    assert [rc for rc, _, _ in results] == [0, 0], results
    assert len((tmp_path / "builds").read_text().splitlines()) == 1, "the second run reuses the first's build"
    folder = {out.strip() for _, out, _ in results}
    assert len(folder) == 1 and Path(folder.pop(), "bin", "kueue").is_file()


def test_two_cold_testbin_builds_at_once_build_the_control_plane_once_then_the_node_binaries(tmp_path):
    """The cold path CI takes on a fresh machine (the real build takes about 13 minutes): every binary lands whole,
    once; `--node` then adds the kubelet, kubeadm and kube-proxy from the same module without rebuilding the rest."""
    results = run_at_once(ROOT / "scripts" / "testbin.sh", tmp_path)
    assert [rc for rc, _, _ in results] == [0, 0], results
    bin_dir = Path({out.strip().splitlines()[-1] for _, out, _ in results}.pop())
    control_plane = ["kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubectl", "etcd"]
    assert all((bin_dir / b).is_file() for b in control_plane) and (bin_dir / "VERSION").is_file()
    builds = (tmp_path / "builds").read_text().splitlines()
    assert sum("kube-apiserver" in b for b in builds) == 1 and sum("etcd" in b for b in builds) == 1, builds
    [(rc, out, err)] = run_at_once(ROOT / "scripts" / "testbin.sh", tmp_path, "--node", runs=1)
    assert rc == 0, err
    assert all((bin_dir / b).is_file() for b in ("kubelet", "kubeadm", "kube-proxy"))
    builds = (tmp_path / "builds").read_text().splitlines()
    assert sum("kube-apiserver" in b for b in builds) == 1 and sum("kubelet" in b for b in builds) == 1, builds


def test_node_scripts_pass_shellcheck():
    scripts = [ROOT / "scripts" / name for name in ("kindbin.sh", "testbin.sh", "kueuebin.sh")]
    scripts += sorted(NODE.glob("*.sh"))
    result = subprocess.run(["shellcheck", "--severity=style", *map(str, scripts)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout


def test_storage_manifest_resolves_kinds_image_names_to_the_ones_built_here(tmp_path):
    source = tmp_path / "const_storage.go"
    source.write_text(textwrap.dedent('''\
        package nodeimage
        const storageProvisionerImage = "docker.io/kindest/local-path-provisioner:v1"
        const defaultStorageManifest = `
        kind: Deployment
        image: ` + storageProvisionerImage + `
        args: [--helper-image, ` + storageHelperImage + `]
        `
        '''))
    out = subprocess.run(["python3", str(NODE / "storage_manifest.py"), str(source), "here/p:1", "here/h:2"],
                         capture_output=True, text=True, check=True).stdout
    assert out == "\nkind: Deployment\nimage: here/p:1\nargs: [--helper-image, here/h:2]\n"
    source.write_text(source.read_text().replace("storageHelperImage", "someOtherImage"))
    refused = subprocess.run(["python3", str(NODE / "storage_manifest.py"), str(source), "p", "h"],
                             capture_output=True, text=True)
    assert refused.returncode != 0 and "someOtherImage" in refused.stderr


@pytest.mark.parametrize(("bounding", "restricted"), [("000001fffeffffff", True), ("000001ffffffffff", False)],
                         ids=["no-CAP_SYS_RESOURCE", "full-bounding-set"])
def test_containerd_restricts_oom_scores_only_where_the_node_cannot_lower_them(tmp_path, bounding, restricted):
    """restrict-oom-score.sh edits /etc/containerd/config.toml; run here on copies of the paths it reads."""
    config = tmp_path / "config.toml"
    config.write_text("[plugins]\n  restrict_oom_score_adj = false\n")
    status = tmp_path / "status"
    status.write_text(f"Name:\tsh\nCapBnd:\t{bounding}\n")
    script = (NODE / "restrict-oom-score.sh").read_text()
    script = script.replace("/proc/self/status", str(status)).replace("/etc/containerd/config.toml", str(config))
    subprocess.run(["sh", "-c", script], check=True, capture_output=True)
    assert ("restrict_oom_score_adj = true" in config.read_text()) is restricted


def test_kindbin_names_its_node_image_without_building():
    out = subprocess.run(["bash", str(ROOT / "scripts" / "kindbin.sh"), "--image"], capture_output=True, text=True,
                         check=True, timeout=10).stdout.strip()
    assert out.startswith("paratrain.local/kind-node:v1.37.2-r")
