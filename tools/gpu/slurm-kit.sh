#!/usr/bin/env bash
# Builds, HERE (Debian 12 with apt and the internet), the SLURM kit for a GPU machine that has no
# network and no SLURM: Debian 12's SLURM 22.05 + munge .deb files and the shared-library closure of
# every binary and plugin in them, with a manifest. tools/gpu/slurm-boot.sh installs it there without
# apt (tests/slurm_cluster/kit_install.py) and boots the cluster (docs/slurm-test-cluster.md, "SLURM
# on the GPU machine").
#
# Usage: bash tools/gpu/slurm-kit.sh [OUT]      (default OUT=.gpu-bundle/slurm, git-ignored)
#
# OUT/*.deb        the packages, as apt downloads them (compressed)
# OUT/manifest.tsv role, package, version, .deb file, sonames:
#                  role "slurm": installed as is (its own files into /);
#                  role "dep":   a library package; only the listed sonames (soname=path in the
#                                package) that the target's `ldconfig -p` lacks are installed;
#                  row "meta glibc <v>": the newest GLIBC_ symbol version any kit ELF needs.
set -euo pipefail
export LC_ALL=C
OUT="${1:-.gpu-bundle/slurm}"
CAP_MIB="${CAP_MIB:-55}"
# What the GPU machine needs: the daemons, the client commands, the plugins boot.sh's slurm.conf
# names (select/cons_tres, gres/gpu, gpu/generic, proctrack/linuxproc, task/none, auth+cred/munge,
# jobcomp/filetxt, preempt/partition_prio, sched/backfill, ... all in slurm-wlm-basic-plugins), munge.
SEED=(slurmctld slurmd slurm-client slurm-wlm-basic-plugins munge libmunge2)
# Never bundled: the C runtime every Linux program already loads (a foreign glibc cannot be swapped
# in anyway; the manifest's glibc row says how new the target's must be).
BASE_PKGS="libc6 libgcc-s1 libstdc++6"

log() { printf '[slurm-kit] %s\n' "$*"; }
die() { printf '[slurm-kit] ERROR: %s\n' "$*" >&2; exit 1; }
for t in apt-get dpkg-deb dpkg ldd objdump; do command -v "$t" >/dev/null || die "needs $t (Debian 12 with binutils)"; done
. /etc/os-release
[ "${ID:-}" = debian ] && [ "${VERSION_ID:-}" = 12 ] || die "build the kit on Debian 12 (this is ${PRETTY_NAME:-unknown})"

scratch="$(mktemp -d /tmp/slurm-kit.XXXXXX)"
trap 'rm -rf "$scratch"' EXIT
mkdir -p "$scratch/debs" "$scratch/root" "$scratch/deproot"
# apt's sandbox user _apt cannot write a root-only mktemp dir.
chmod 0755 "$scratch" "$scratch/debs"

log "downloading ${SEED[*]}"
(cd "$scratch/debs" && apt-get download -q "${SEED[@]}" 2>&1 | grep -v -e '^Get:' -e 'unsandboxed' -e '^Fetched' || true)
for p in "${SEED[@]}"; do compgen -G "$scratch/debs/${p}_*.deb" >/dev/null || die "apt-get download $p failed"; done
for d in "$scratch"/debs/*.deb; do dpkg-deb -x "$d" "$scratch/root"; done

# Every ELF file of the seed packages: executables, libslurmfull, every plugin (plugins are
# dlopen'ed, so only ldd of each plugin file itself shows what it needs).
mapfile -t elfs < <(find "$scratch/root" -type f -print0 | xargs -0 -r file -N -F '|' | awk -F'|' '$2 ~ / ELF /{print $1}' | sort)
[ "${#elfs[@]}" -gt 50 ] || die "found only ${#elfs[@]} ELF files in the seed packages"
log "scanning ${#elfs[@]} ELF files with ldd"
# The seed's own libraries (libslurmfull.so, libmunge.so.2) resolve inside the scratch copy, so the
# scan does not depend on SLURM being installed here.
libpath="$(find "$scratch/root" -type f -name '*.so*' -printf '%h\n' | sort -u | paste -sd:)"
: >"$scratch/needs"
for f in "${elfs[@]}"; do
  out="$(LD_LIBRARY_PATH="$libpath" ldd "$f" 2>&1 || true)"
  if grep -q 'not found' <<<"$out"; then die "ldd ${f#"$scratch/root"}: $(grep 'not found' <<<"$out" | tr '\n' ' ')"; fi
  # "libfoo.so.1 => /lib/x86_64-linux-gnu/libfoo.so.1 (0x...)"
  awk -v self="${f#"$scratch/root"}" '$2=="=>" && $3 ~ /^\// {print $1, $3, self}' <<<"$out" >>"$scratch/needs"
done

# soname -> the installed Debian package that owns the file ldd resolved it to.
owner_of() { # path -> package (merged /usr: dpkg may know a lib as /lib/... or /usr/lib/...)
  local p="$1" q
  for q in "$p" "$(readlink -f "$p")" "/usr$p" "${p#/usr}"; do
    dpkg -S "$q" 2>/dev/null | head -n1 | cut -d: -f1 && return 0
  done
  return 1
}
declare -A pkg_of_soname=()
while read -r soname path _; do
  [[ "$path" == "$scratch"/* ]] && continue            # the seed's own library
  [ -n "${pkg_of_soname[$soname]:-}" ] && continue
  pkg="$(owner_of "$path")" || die "no Debian package owns $path (needed as $soname)"
  pkg_of_soname[$soname]="$pkg"
done <"$scratch/needs"

declare -A sonames_of_pkg=()
for s in "${!pkg_of_soname[@]}"; do
  pkg="${pkg_of_soname[$s]}"
  case " $BASE_PKGS ${SEED[*]} " in *" $pkg "*) continue ;; esac
  sonames_of_pkg[$pkg]="${sonames_of_pkg[$pkg]:+${sonames_of_pkg[$pkg]} }$s"
done
deps=($(printf '%s\n' "${!sonames_of_pkg[@]}" | sort))
log "dependency library packages (${#deps[@]}): ${deps[*]}"
(cd "$scratch/debs" && apt-get download -q "${deps[@]}" 2>&1 | grep -v -e '^Get:' -e 'unsandboxed' -e '^Fetched' || true)

rm -rf "$OUT"; mkdir -p "$OUT"
{
  printf '# rlslurm SLURM kit, built %s on %s by tools/gpu/slurm-kit.sh\n' "$(date -u +%FT%TZ)" "$PRETTY_NAME"
  printf '# role\tpackage\tversion\tdeb\tsonames (soname=path in the package)\n'
} >"$OUT/manifest.tsv"
glibc_of() { objdump -T "$@" 2>/dev/null | grep -o 'GLIBC_[0-9][0-9.]*' | sed 's/GLIBC_//' || true; }
glibc_of "${elfs[@]}" >"$scratch/glibc"
for d in "$scratch"/debs/*.deb; do
  pkg="$(dpkg-deb -f "$d" Package)"; ver="$(dpkg-deb -f "$d" Version)"
  # The installer reads data.tar.{xz,gz} with Python's tarfile (no zstd there).
  member="$(ar t "$d" | grep '^data\.tar')"
  case "$member" in data.tar.xz|data.tar.gz) ;; *) die "$d has $member; kit_install.py reads xz/gz only" ;; esac
  cp "$d" "$OUT/"
  if [ -n "${sonames_of_pkg[$pkg]:-}" ]; then
    rm -rf "$scratch/deproot"; mkdir -p "$scratch/deproot"; dpkg-deb -x "$d" "$scratch/deproot"
    entries=""
    for s in ${sonames_of_pkg[$pkg]}; do
      rel="$(cd "$scratch/deproot" && find . \( -type f -o -type l \) -name "$s" -path '*/lib/*' | sed 's|^\./||' | sort | head -n1)"
      [ -n "$rel" ] || die "$pkg ($d) has no file named $s"
      real="$(readlink -f "$scratch/deproot/$rel")"
      [ -f "$real" ] || die "$pkg: $rel is a dangling link"
      glibc_of "$real" >>"$scratch/glibc"
      entries="${entries:+$entries,}$s=$rel"
    done
    printf 'dep\t%s\t%s\t%s\t%s\n' "$pkg" "$ver" "$(basename "$d")" "$entries" >>"$OUT/manifest.tsv"
  else
    case " ${SEED[*]} " in *" $pkg "*) ;; *) die "downloaded $pkg, which is neither seed nor dependency" ;; esac
    printf 'slurm\t%s\t%s\t%s\t-\n' "$pkg" "$ver" "$(basename "$d")" >>"$OUT/manifest.tsv"
  fi
done
glibc="$(sort -t. -k1,1n -k2,2n -u "$scratch/glibc" | tail -n1)"
printf 'meta\tglibc\t%s\t-\t-\n' "$glibc" >>"$OUT/manifest.tsv"

total=$(du -cb "$OUT"/* | tail -n1 | cut -f1)
mib=$(awk -v b="$total" 'BEGIN{printf "%.1f", b/1048576}')
log "packages: $(ls "$OUT"/*.deb | wc -l) ($(grep -c '^slurm' "$OUT/manifest.tsv") slurm/munge + $(grep -c '^dep' "$OUT/manifest.tsv") library), needs glibc >= $glibc"
grep -v '^# rlslurm' "$OUT/manifest.tsv" | column -t -s $'\t' | sed 's/^/  /'
[ "$total" -le $((CAP_MIB * 1048576)) ] || die "kit is $mib MiB, over the $CAP_MIB MiB cap"
log "kit: $OUT, $mib MiB in all"
