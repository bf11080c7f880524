package nri

import (
	"fmt"
	"path"
	"slices"
	"strings"

	nriapi "github.com/containerd/nri/pkg/api"
	"github.com/prometheus/procfs"

	"github.com/mountplan/mountplan/internal/errdefs"
)

// pidsOf returns the host PID of each container's process, by ID: the PID
// the runtime gives, or, when it gives none, the process found in the
// container's cgroup. containerd gives the PID at StartContainer and at
// Synchronize; CRI-O gives NRI plugins no PID at all (v1.34), while the
// container's process already runs in its cgroup at StartContainer (the
// runtime has created it; it waits to be started). Without the PID the
// plugin cannot record the container's namespace (so as to tell when the
// container is gone) and the mounter cannot perform a plan at start
// (AtStart: a subPath). One pass over proc serves every container asked
// about, and it happens only for containers the runtime gave no PID.
func pidsOf(proc string, ctrs []*nriapi.Container) (map[string]int, error) {
	pids := map[string]int{}
	leaves := map[string]string{} // cgroup leaf -> container ID
	for _, ctr := range ctrs {
		if pid := ctr.GetPid(); pid != 0 {
			pids[ctr.GetId()] = int(pid)
			continue
		}
		if leaf := cgroupLeaf(ctr.GetLinux().GetCgroupsPath()); leaf != "" {
			leaves[leaf] = ctr.GetId()
		}
	}
	if len(leaves) == 0 {
		return pids, nil
	}
	fs, err := procfs.NewFS(proc)
	if err != nil {
		return pids, err
	}
	procs, err := fs.AllProcs()
	if err != nil {
		return pids, err
	}
	members := map[string][]procfs.Proc{} // container ID -> its processes
	for _, p := range procs {
		cgs, err := p.Cgroups()
		if err != nil {
			continue // gone since the listing
		}
		for _, cg := range cgs {
			if id, ok := leaves[path.Base(cg.Path)]; ok {
				members[id] = append(members[id], p)
				break
			}
		}
	}
	for id, ps := range members {
		pids[id] = initOf(ps)
	}
	return pids, nil
}

// pidOf is pidsOf for one container; an error when no PID is found.
func pidOf(proc string, ctr *nriapi.Container) (int, error) {
	pids, err := pidsOf(proc, []*nriapi.Container{ctr})
	if pid := pids[ctr.GetId()]; pid != 0 {
		return pid, nil
	}
	if err == nil {
		err = fmt.Errorf("the runtime gave no PID of container %s, and no process is in its cgroup %q: %w",
			ctr.GetId(), ctr.GetLinux().GetCgroupsPath(), errdefs.ErrFailedPrecondition)
	}
	return 0, err
}

// cgroupLeaf is the last component of the cgroup a runtime puts a
// container in, from the OCI spec's cgroupsPath: a path (cgroupfs), or
// "slice:prefix:name" (the systemd driver), whose unit is
// "prefix-name.scope". /proc/PID/cgroup shows paths relative to the
// reader's cgroup namespace, so only the leaf is compared.
func cgroupLeaf(cgroupsPath string) string {
	if parts := strings.Split(cgroupsPath, ":"); len(parts) == 3 {
		if parts[1] == "" {
			return parts[2]
		}
		return parts[1] + "-" + parts[2] + ".scope"
	}
	if cgroupsPath == "" {
		return ""
	}
	return path.Base(cgroupsPath)
}

// initOf picks the container's first process among those in its cgroup:
// the one whose parent is not in it (the runtime's monitor started it),
// the lowest PID among several such.
func initOf(ps []procfs.Proc) int {
	in := map[int]bool{}
	for _, p := range ps {
		in[p.PID] = true
	}
	var roots []int
	for _, p := range ps {
		if st, err := p.Stat(); err == nil && !in[st.PPID] {
			roots = append(roots, p.PID)
		}
	}
	if len(roots) == 0 {
		return 0
	}
	return slices.Min(roots)
}
