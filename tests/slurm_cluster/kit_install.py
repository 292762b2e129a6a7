#!/usr/bin/env python3
"""Install SLURM + munge from a kit (tools/gpu/slurm-kit.sh) without apt or dpkg.

For machines that have neither the network nor (maybe) dpkg, such as the GPU machines: boot.sh
calls this when RLSLURM_CI_KIT names a kit directory. Standard library only; any Linux with Python 3.8+.

* "slurm" packages (slurmctld, slurmd, slurm-client, slurm-wlm-basic-plugins, munge, libmunge2):
  their files go into / as `dpkg -x` would put them, except that an existing file is never
  rewritten: an identical one is left as is (so re-running, or running on a machine that has the
  same packages from apt, writes nothing), a different one is kept and reported. New files are
  written beside their target and renamed into place, so a running daemon never sees a half-written
  binary or library. Then what the maintainer scripts would do that SLURM needs here: the
  update-alternatives links /usr/sbin/slurmctld, slurmd, slurmstepd (-> *-wlm), the munge user and
  munge's directory owners and modes.
* "dep" packages (libraries): only the sonames the manifest lists and `ldconfig -p` does not
  already know go into LIBDIR (default /opt/rlslurm-slurm/lib), which a file in /etc/ld.so.conf.d
  registers; the image's own libraries (torch, CUDA, ...) are never touched or shadowed.
* Finally every installed ELF is checked with ldd: any "not found" (a missing library or a too-old
  symbol version) fails the install with the list.

Usage: kit_install.py KIT_DIR [--libdir /opt/rlslurm-slurm/lib]
       (--root DIR and --assume-missing SONAME,... are for testing into a scratch root)
"""

from __future__ import annotations

import argparse
import io
import os
import re
import shutil
import subprocess
import sys
import tarfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

LDCONF_NAME = "rlslurm-slurm.conf"
MULTIARCH = "/usr/lib/x86_64-linux-gnu"
ALTERNATIVES = {  # what slurmctld's / slurmd's postinst make with update-alternatives
    "usr/sbin/slurmctld": "slurmctld-wlm",
    "usr/sbin/slurmd": "slurmd-wlm",
    "usr/sbin/slurmstepd": "slurmstepd-wlm",
}


def log(msg: str) -> None:
    print(f"[kit-install] {msg}", flush=True)


def die(msg: str) -> None:
    print(f"[kit-install] ERROR: {msg}", file=sys.stderr, flush=True)
    sys.exit(1)


def read_manifest(kit: Path) -> tuple[list[dict], str | None]:
    rows, glibc = [], None
    for line in (kit / "manifest.tsv").read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        role, pkg, ver, deb, sonames = line.split("\t")
        if role == "meta":
            if pkg == "glibc":
                glibc = ver
            continue
        libs = {}
        if sonames != "-":
            for item in sonames.split(","):
                name, _, path = item.partition("=")
                libs[name] = path
        rows.append({"role": role, "pkg": pkg, "ver": ver, "deb": kit / deb, "libs": libs})
    if not rows:
        die(f"{kit}/manifest.tsv lists no packages")
    return rows, glibc


def deb_data(deb: Path) -> tarfile.TarFile:
    """The data.tar.{xz,gz} member of a .deb (an `ar` archive), opened with tarfile."""
    blob = deb.read_bytes()
    if not blob.startswith(b"!<arch>\n"):
        die(f"{deb} is not a .deb (ar) file")
    off = 8
    while off + 60 <= len(blob):
        hdr = blob[off:off + 60]
        name = hdr[:16].decode().strip().rstrip("/")
        size = int(hdr[48:58].decode().strip())
        off += 60
        if name.startswith("data.tar"):
            if name not in ("data.tar.xz", "data.tar.gz"):
                die(f"{deb}: {name} is not readable here (xz/gz only)")
            return tarfile.open(fileobj=io.BytesIO(blob[off:off + size]), mode="r:*")
        off += size + (size & 1)
    die(f"{deb} has no data.tar member")
    raise AssertionError


def same_file(path: Path, data: bytes) -> bool:
    try:
        return path.is_file() and path.stat().st_size == len(data) and path.read_bytes() == data
    except OSError:
        return False


def write_new(path: Path, data: bytes, mode: int) -> None:
    """Write beside the target, then rename: a reader sees the old file or the whole new one."""
    tmp = path.with_name(f".{path.name}.kit-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
    os.chmod(tmp, mode)
    os.replace(tmp, path)


class Counts:
    def __init__(self) -> None:
        self.new: list[str] = []
        self.same = 0
        self.kept: list[str] = []
        self.elfs: list[Path] = []


def install_package(deb: Path, root: Path, c: Counts) -> None:
    with deb_data(deb) as tar:
        members = tar.getmembers()
        for m in members:
            rel = os.path.normpath(m.name).lstrip("/")
            if rel in ("", "."):
                continue
            dest = root / rel
            if m.isdir():
                if not dest.exists():
                    dest.mkdir(parents=True, mode=m.mode & 0o7777)
                    os.chmod(dest, m.mode & 0o7777)
                continue
            dest.parent.mkdir(parents=True, exist_ok=True)
            if m.issym():
                if dest.is_symlink() and os.readlink(dest) == m.linkname:
                    c.same += 1
                elif dest.exists() or dest.is_symlink():
                    c.kept.append(f"/{rel} (link)")
                else:
                    os.symlink(m.linkname, dest)
                    c.new.append(f"/{rel}")
                continue
            if m.islnk():
                src = tar.extractfile(tar.getmember(m.linkname))
            elif m.isfile():
                src = tar.extractfile(m)
            else:
                continue
            data = src.read() if src else b""
            if data[:4] == b"\x7fELF":
                c.elfs.append(dest)
            if same_file(dest, data):
                c.same += 1
            elif dest.exists() or dest.is_symlink():
                c.kept.append(f"/{rel}")
            else:
                write_new(dest, data, m.mode & 0o7777)
                c.new.append(f"/{rel}")


def ldconfig_sonames(exclude_dir: Path) -> dict[str, str]:
    """soname -> path for the 64-bit libraries the loader cache knows, ours (exclude_dir) left out."""
    out = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True, check=True).stdout
    known: dict[str, str] = {}
    for line in out.splitlines():
        m = re.match(r"\s+(\S+) \(([^)]*)\) => (\S+)", line)
        if not m or "x86-64" not in m.group(2):
            continue
        if Path(m.group(3)).parent == exclude_dir:
            continue
        known.setdefault(m.group(1), m.group(3))
    return known


def member_bytes(tar: tarfile.TarFile, name: str, depth: int = 0) -> bytes:
    """A file's content inside the package, following symlinks (libfoo.so.1 -> libfoo.so.1.2.3)."""
    if depth > 10:
        die(f"symlink loop at {name}")
    rel = os.path.normpath(name).lstrip("/")
    m = next((x for x in (f"./{rel}", rel) if x in tar.getnames()), None)
    if m is None:
        die(f"{name} is not in the package")
    m = tar.getmember(m)
    if m.issym():
        target = m.linkname if m.linkname.startswith("/") else os.path.join(os.path.dirname(rel), m.linkname)
        return member_bytes(tar, target, depth + 1)
    if m.islnk():
        return member_bytes(tar, m.linkname, depth + 1)
    f = tar.extractfile(m)
    if f is None:
        die(f"{name} is not a regular file")
    return f.read()


def ensure_munge_user() -> None:
    if subprocess.run(["id", "-u", "munge"], capture_output=True).returncode == 0:
        return
    tries = [
        ["useradd", "--system", "--user-group", "--no-create-home", "--home-dir", "/nonexistent",
         "--shell", "/usr/sbin/nologin", "munge"],
        ["adduser", "--quiet", "--system", "--group", "--no-create-home", "--home", "/nonexistent", "munge"],
    ]
    for cmd in tries:
        if shutil.which(cmd[0]) and subprocess.run(cmd, capture_output=True).returncode == 0:
            log(f"created system user munge ({cmd[0]})")
            return
    die("no user 'munge' and neither useradd nor adduser could create it")


def munge_dirs(root: Path) -> None:
    """What munge's postinst does besides the user: owners and modes munged insists on."""
    import grp
    import pwd
    uid, gid = pwd.getpwnam("munge").pw_uid, grp.getgrnam("munge").gr_gid
    for d, mode in (("etc/munge", 0o700), ("var/lib/munge", 0o711), ("var/log/munge", 0o700)):
        p = root / d
        p.mkdir(parents=True, exist_ok=True)
        os.chown(p, uid, gid)
        os.chmod(p, mode)


def glibc_ok(need: str | None) -> None:
    if not need:
        return
    try:
        have = os.confstr("CS_GNU_LIBC_VERSION") or ""
    except (ValueError, OSError):
        have = ""
    m = re.search(r"(\d+)\.(\d+)", have)
    if not m:
        die(f"not a glibc system ({have or 'no CS_GNU_LIBC_VERSION'}); the kit's binaries need glibc >= {need}")
    if tuple(map(int, m.groups())) < tuple(map(int, need.split(".")[:2])):
        die(f"{have} is older than the glibc {need} the kit's binaries need")
    log(f"{have} (kit needs >= {need})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("kit", type=Path)
    ap.add_argument("--root", type=Path, default=Path("/"))
    ap.add_argument("--libdir", type=Path, default=Path("/opt/rlslurm-slurm/lib"))
    ap.add_argument("--assume-missing", default="", type=lambda v: [x for x in v.split(",") if x],
                    help="testing: sonames to install as if `ldconfig -p` lacked them")
    a = ap.parse_args()
    if os.geteuid() != 0:
        die("must run as root")
    rows, glibc = read_manifest(a.kit)
    glibc_ok(glibc)
    for r in rows:
        if not r["deb"].is_file():
            die(f"{r['deb']} missing (the manifest lists it)")

    c = Counts()
    for r in rows:
        if r["role"] == "slurm":
            install_package(r["deb"], a.root, c)
    for link, target in ALTERNATIVES.items():
        p = a.root / link
        if not (p.exists() or p.is_symlink()) and (p.parent / target).exists():
            os.symlink(target, p)
            c.new.append(f"/{link} -> {target}")
    pkgs = ", ".join(f"{r['pkg']} {r['ver']}" for r in rows if r["role"] == "slurm")
    log(f"slurm/munge packages ({pkgs}): {len(c.new)} new, {c.same} already identical, {len(c.kept)} kept (differ)")
    for k in c.kept:
        log(f"  kept the existing {k} (differs from the kit's)")
    ensure_munge_user()
    munge_dirs(a.root)

    # Library packages: only what the image lacks, into our own directory.
    libdir = a.root / a.libdir.relative_to("/")
    known = ldconfig_sonames(libdir)
    for s in a.assume_missing:  # testing: act as if the image lacked these
        known.pop(s, None)
    added, present = [], []
    for r in rows:
        if r["role"] != "dep":
            continue
        todo = {s: p for s, p in r["libs"].items() if s not in known}
        present += [s for s in r["libs"] if s in known]
        if not todo:
            continue
        libdir.mkdir(parents=True, exist_ok=True)
        with deb_data(r["deb"]) as tar:
            for soname, path in todo.items():
                data = member_bytes(tar, path)
                dest = libdir / soname
                if not same_file(dest, data):
                    write_new(dest, data, 0o644)
                c.elfs.append(dest)
                added.append(f"{soname} ({r['pkg']} {r['ver']})")
    conf_lines = [str(a.libdir)] if added else []
    # A non-Debian loader does not search the multiarch dir where libmunge2 puts libmunge.so.2.
    if "libmunge.so.2" not in ldconfig_sonames(libdir):
        conf_lines.append(MULTIARCH)
    ldconf = a.root / "etc/ld.so.conf.d" / LDCONF_NAME
    if conf_lines:
        ldconf.parent.mkdir(parents=True, exist_ok=True)
        text = ("# rlslurm SLURM kit (tests/slurm_cluster/kit_install.py): libraries the image lacked\n"
                + "\n".join(conf_lines) + "\n")
        if not (ldconf.is_file() and ldconf.read_text() == text):
            write_new(ldconf, text.encode(), 0o644)
    elif ldconf.exists():
        ldconf.unlink()  # an earlier install needed it; this image no longer does
    subprocess.run(["ldconfig"], check=True)
    log(f"libraries from the image: {len(present)} ({' '.join(sorted(present)) or '-'})")
    log(f"libraries added to {a.libdir}: {len(added)} ({', '.join(sorted(added)) or '-'})")

    def unresolved(f: Path) -> str | None:
        out = subprocess.run(["ldd", str(f)], capture_output=True, text=True)
        miss = [ln.strip() for ln in (out.stdout + out.stderr).splitlines() if "not found" in ln]
        return f"{f}: {'; '.join(miss)}" if miss else None

    with ThreadPoolExecutor(max_workers=min(16, os.cpu_count() or 1)) as pool:
        bad = [b for b in pool.map(unresolved, sorted(set(c.elfs))) if b]
    if bad:
        die("unresolved libraries after the install:\n  " + "\n  ".join(bad))
    log(f"ldd: all {len(set(c.elfs))} ELF files of the kit resolve")


if __name__ == "__main__":
    main()
