"""What kind of filesystem a path is on: node-local or shared over the network (for the Slurm lint and staging)."""

from __future__ import annotations

from pathlib import Path

# Filesystems that live on one node: a multi-node job's other nodes cannot see a run dir there.
NODE_LOCAL_FS = frozenset({"tmpfs", "ramfs", "ext2", "ext3", "ext4", "xfs", "btrfs", "overlay", "f2fs", "zfs"})
# Filesystems every node reads over the network.
NETWORK_FS = frozenset({"nfs", "nfs4", "lustre", "gpfs", "beegfs", "cephfs", "ceph", "glusterfs", "fuse.glusterfs",
                        "panfs", "wekafs", "cifs", "smb3", "pvfs2", "orangefs", "afs", "fuse.sshfs"})


def filesystem_type(path: Path) -> str:
    """Type of the filesystem holding ``path`` (longest mount point prefix in /proc/mounts)."""
    path = path.resolve()
    while not path.exists():
        path = path.parent
    best, fstype = "", ""
    try:
        mounts = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return ""
    for line in mounts:
        parts = line.split()
        if len(parts) < 3:
            continue
        mount = parts[1].replace("\\040", " ")
        if (str(path) == mount or str(path).startswith(mount.rstrip("/") + "/")) and len(mount) >= len(best):
            best, fstype = mount, parts[2]
    return fstype
