package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"
)

// clockTicksPerSecond is USER_HZ, the unit of /proc/<pid>/stat's utime
// and stime: sysconf(_SC_CLK_TCK), 100 on the architectures bench runs
// on.
const clockTicksPerSecond = 100

// cpuSample is a process's CPU time so far, read two ways: per thread,
// from /proc/<pid>/task/<tid>/schedstat (nanoseconds on CPU, the most
// precise figure Linux gives; /proc/<pid>/schedstat is the main
// thread's alone), and for the whole process from /proc/<pid>/stat
// (utime + stime in clock ticks, which keeps the time of threads that
// have exited).
type cpuSample struct {
	threads map[int]time.Duration
	ticks   int64
}

// readCPU samples pid's CPU time.
func readCPU(pid int) (cpuSample, error) {
	stat, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return cpuSample{}, err
	}
	s := cpuSample{threads: map[int]time.Duration{}}
	if s.ticks, err = parseStatCPU(string(stat)); err != nil {
		return cpuSample{}, fmt.Errorf("/proc/%d/stat: %w", pid, err)
	}
	dir := fmt.Sprintf("/proc/%d/task", pid)
	tasks, err := os.ReadDir(dir)
	if err != nil {
		return cpuSample{}, err
	}
	for _, t := range tasks {
		tid, err := strconv.Atoi(t.Name())
		if err != nil {
			continue
		}
		b, err := os.ReadFile(filepath.Join(dir, t.Name(), "schedstat"))
		if errors.Is(err, os.ErrNotExist) {
			continue // the thread exited since the listing
		}
		if err != nil {
			return cpuSample{}, err
		}
		if s.threads[tid], err = parseSchedstat(string(b)); err != nil {
			return cpuSample{}, fmt.Errorf("%s/%d/schedstat: %w", dir, tid, err)
		}
	}
	return s, nil
}

// cpuBetween is the CPU time a process had between samples a and b: its
// threads' own figures when every thread of a is still there in b (the
// Go runtime keeps the threads it starts; a thread new in b counts
// whole, it started after a), else the process's figure, in clock ticks.
func cpuBetween(a, b cpuSample) time.Duration {
	var d time.Duration
	for tid, t := range b.threads {
		d += t - a.threads[tid]
	}
	for tid := range a.threads {
		if _, ok := b.threads[tid]; !ok {
			return time.Duration(b.ticks-a.ticks) * time.Second / clockTicksPerSecond
		}
	}
	return d
}

// parseSchedstat reads the time on CPU, the first of the three fields
// of a schedstat file (time on CPU and time waiting to run, in
// nanoseconds, then the number of time slices).
func parseSchedstat(s string) (time.Duration, error) {
	f := strings.Fields(s)
	if len(f) != 3 {
		return 0, fmt.Errorf("schedstat %q: want 3 fields", s)
	}
	ns, err := strconv.ParseInt(f[0], 10, 64)
	if err != nil || ns < 0 {
		return 0, fmt.Errorf("schedstat %q: time on CPU is not a count of nanoseconds", s)
	}
	return time.Duration(ns), nil
}

// parseStatCPU reads utime + stime, fields 14 and 15 of a
// /proc/<pid>/stat line, in clock ticks. Fields are counted after the
// command's closing parenthesis: the command (field 2) may hold spaces
// and parentheses of its own.
func parseStatCPU(s string) (int64, error) {
	i := strings.LastIndexByte(s, ')')
	if i < 0 {
		return 0, errors.New("no command in parentheses")
	}
	f := strings.Fields(s[i+1:]) // from field 3, the state
	if len(f) < 13 {
		return 0, fmt.Errorf("%d fields after the command, want at least 13", len(f))
	}
	var ticks int64
	for _, v := range f[11:13] { // fields 14 and 15
		n, err := strconv.ParseInt(v, 10, 64)
		if err != nil || n < 0 {
			return 0, fmt.Errorf("utime or stime %q is not a count of clock ticks", v)
		}
		ticks += n
	}
	return ticks, nil
}

// measureCPU is measure, with the CPU time process pid had meanwhile.
func measureCPU(ctx context.Context, pid int, op func(context.Context) error, conc, n int) (result, time.Duration, error) {
	before, err := readCPU(pid)
	if err != nil {
		return result{}, 0, err
	}
	r := measure(ctx, op, conc, n)
	after, err := readCPU(pid)
	if err != nil {
		return result{}, 0, err
	}
	return r, cpuBetween(before, after), nil
}

// microsPer is d in microseconds per one of n.
func microsPer(d time.Duration, n int) float64 {
	if n == 0 {
		return 0
	}
	return float64(d.Nanoseconds()) / 1000 / float64(n)
}
