package testcluster

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// What a node makes on the host outside its directory, and how teardown
// finds it again: the kubelet's cgroup in every hierarchy, the shims of
// its containerd, and the mounts under its directory.

// cgroupDirs returns the directory of cgroup (e.g. /tokenbroker-x) in
// every hierarchy of the host: one per v1 controller, or the one v2 tree.
func cgroupDirs(cgroup string) (dirs []string, v1 bool) {
	if isFile(filepath.Join(cgroupRoot, "cgroup.controllers")) {
		return []string{filepath.Join(cgroupRoot, cgroup)}, false
	}
	entries, _ := os.ReadDir(cgroupRoot)
	for _, e := range entries {
		h := filepath.Join(cgroupRoot, e.Name())
		if e.IsDir() && isFile(filepath.Join(h, "cgroup.procs")) {
			dirs = append(dirs, filepath.Join(h, cgroup))
		}
	}
	return dirs, true
}

// makeCgroups creates the kubelet's cgroupRoot in every hierarchy (the
// kubelet wants it to exist in each). A v1 cpuset cgroup starts with no
// CPUs and no memory nodes: it gets its parent's.
func makeCgroups(cgroup string) (v1 bool, err error) {
	dirs, v1 := cgroupDirs(cgroup)
	if len(dirs) == 0 {
		return v1, fmt.Errorf("no cgroup hierarchy under %s", cgroupRoot)
	}
	for _, d := range dirs {
		if err := os.MkdirAll(d, 0o755); err != nil {
			return v1, fmt.Errorf("create cgroup: %w", err)
		}
		if v1 && filepath.Base(filepath.Dir(d)) == "cpuset" {
			for _, f := range []string{"cpuset.cpus", "cpuset.mems"} {
				b, err := os.ReadFile(filepath.Join(filepath.Dir(d), f))
				if err != nil {
					return v1, err
				}
				if err := os.WriteFile(filepath.Join(d, f), b, 0o644); err != nil {
					return v1, fmt.Errorf("set %s: %w", f, err)
				}
			}
		}
	}
	return v1, nil
}

// killCgroup kills every process in cgroup and below (the containers of
// the node's pods), until none is left or five seconds have passed. It
// thaws every frozen cgroup first: runc freezes a container's cgroup while
// it kills it, and a frozen process does not die of SIGKILL, so a runc
// killed in between (the kubelet's teardown, or a test killed) would leave
// it frozen for good.
func killCgroup(cgroup string) {
	dirs, _ := cgroupDirs(cgroup)
	deadline := time.Now().Add(5 * time.Second)
	for time.Now().Before(deadline) {
		var pids []int
		for _, d := range dirs {
			_ = filepath.WalkDir(d, func(path string, e fs.DirEntry, err error) error {
				if err != nil || e.IsDir() {
					return nil
				}
				switch e.Name() {
				case "freezer.state": // v1
					_ = os.WriteFile(path, []byte("THAWED"), 0o644)
				case "cgroup.freeze": // v2
					_ = os.WriteFile(path, []byte("0"), 0o644)
				}
				if e.Name() != "cgroup.procs" {
					return nil
				}
				b, _ := os.ReadFile(path)
				for _, f := range strings.Fields(string(b)) {
					if pid, err := strconv.Atoi(f); err == nil && pid != os.Getpid() {
						pids = append(pids, pid)
					}
				}
				return nil
			})
		}
		if len(pids) == 0 {
			return
		}
		for _, pid := range pids {
			_ = syscall.Kill(pid, syscall.SIGKILL)
		}
		time.Sleep(pollInterval)
	}
}

// removeCgroups removes cgroup and every cgroup below it, deepest first.
func removeCgroups(cgroup string) error {
	dirs, _ := cgroupDirs(cgroup)
	var errs []error
	for _, d := range dirs {
		var all []string
		_ = filepath.WalkDir(d, func(path string, e fs.DirEntry, err error) error {
			if err == nil && e.IsDir() {
				all = append(all, path)
			}
			return nil
		})
		slices.Reverse(all) // children after their parents in a walk
		for _, p := range all {
			if err := syscall.Rmdir(p); err != nil && !errors.Is(err, syscall.ENOENT) {
				errs = append(errs, fmt.Errorf("remove cgroup %s: %w", p, err))
			}
		}
	}
	return errors.Join(errs...)
}

// killShims kills containerd's runc shims that serve the containerd at
// address (each names it with -address); they outlive containerd.
func killShims(address string) {
	procs, _ := os.ReadDir("/proc")
	for _, p := range procs {
		pid, err := strconv.Atoi(p.Name())
		if err != nil {
			continue
		}
		cmdline, err := os.ReadFile(filepath.Join("/proc", p.Name(), "cmdline"))
		if err != nil {
			continue
		}
		args := strings.Split(string(bytes.TrimRight(cmdline, "\x00")), "\x00")
		if !strings.Contains(filepath.Base(args[0]), "containerd-shim") {
			continue
		}
		if i := slices.Index(args, "-address"); i >= 0 && i+1 < len(args) && args[i+1] == address {
			_ = syscall.Kill(pid, syscall.SIGKILL)
		}
	}
}

// unmountUnder detaches every mount at or below dir, deepest first: the
// kubelet's volumes and the bind mount of its root directory, containerd's
// root file systems, shm and network namespaces.
func unmountUnder(dir string) error {
	var errs []error
	for range 3 { // a mount can hide another at the same point
		points, err := mountsUnder(dir)
		if err != nil {
			return err
		}
		if len(points) == 0 {
			return nil
		}
		errs = errs[:0]
		for _, p := range points {
			if err := syscall.Unmount(p, syscall.MNT_DETACH); err != nil && !errors.Is(err, syscall.EINVAL) && !errors.Is(err, syscall.ENOENT) {
				errs = append(errs, fmt.Errorf("unmount %s: %w", p, err))
			}
		}
	}
	return errors.Join(errs...)
}

// mountsUnder lists the mount points at or below dir, longest first.
func mountsUnder(dir string) ([]string, error) {
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		return nil, err
	}
	defer func() { _ = f.Close() }()
	var out []string
	s := bufio.NewScanner(f)
	s.Buffer(make([]byte, 0, 64*1024), 1<<20)
	for s.Scan() {
		fields := strings.Fields(s.Text())
		if len(fields) < 5 {
			continue
		}
		p := unescapeMountPath(fields[4])
		if p == dir || strings.HasPrefix(p, dir+"/") {
			out = append(out, p)
		}
	}
	slices.SortFunc(out, func(a, b string) int { return len(b) - len(a) })
	return out, s.Err()
}

// unescapeMountPath undoes mountinfo's octal escapes (\040 for a space).
func unescapeMountPath(s string) string {
	if !strings.Contains(s, `\`) {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+3 < len(s) {
			if v, err := strconv.ParseUint(s[i+1:i+4], 8, 8); err == nil {
				b.WriteByte(byte(v))
				i += 3
				continue
			}
		}
		b.WriteByte(s[i])
	}
	return b.String()
}
