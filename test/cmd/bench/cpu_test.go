package main

import (
	"os"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

func TestParseSchedstat(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name, in string
		want     time.Duration
		err      bool
	}{
		{name: "The first field is the time on CPU in nanoseconds.", in: "2681411 1200 7\n", want: 2681411 * time.Nanosecond},
		{name: "A file of another shape is an error.", in: "2681411 1200\n", err: true},
		{name: "A time that is not a count is an error.", in: "-5 0 1\n", err: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			got, err := parseSchedstat(tc.in)
			if tc.err {
				require.Error(t, err)
				return
			}
			require.NoError(t, err)
			require.Equal(t, tc.want, got)
		})
	}
}

func TestParseStatCPU(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name, in string
		want     int64
		err      bool
	}{
		{name: "Utime and stime, fields 14 and 15, are added.",
			in: "8076 (cat) R 8073 8073 5827 0 -1 4194304 101 0 0 0 31 12 0 0 20 0 1 0 2446574 3133440 388\n", want: 43},
		{name: "A command with spaces and parentheses does not shift the fields.",
			in: "8076 (a) b (c) R 8073 8073 5827 0 -1 4194304 101 0 0 0 31 12 0 0 20 0 1 0 2446574 3133440 388\n", want: 43},
		{name: "A line without the command is an error.", in: "8076 cat R 1 2 3\n", err: true},
		{name: "A line cut short is an error.", in: "8076 (cat) R 8073 8073 5827 0 -1 4194304 101 0 0 0 31\n", err: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			got, err := parseStatCPU(tc.in)
			if tc.err {
				require.Error(t, err)
				return
			}
			require.NoError(t, err)
			require.Equal(t, tc.want, got)
		})
	}
}

func TestCPUBetween(t *testing.T) {
	t.Parallel()
	ms := time.Millisecond
	t.Run("The threads' times are added, a new thread's whole.", func(t *testing.T) {
		t.Parallel()
		a := cpuSample{threads: map[int]time.Duration{1: 10 * ms, 2: 5 * ms}, ticks: 1}
		b := cpuSample{threads: map[int]time.Duration{1: 13 * ms, 2: 6 * ms, 3: 2 * ms}, ticks: 2}
		require.Equal(t, 6*ms, cpuBetween(a, b))
	})
	t.Run("A thread gone takes its time with it, so the process's clock ticks count.", func(t *testing.T) {
		t.Parallel()
		a := cpuSample{threads: map[int]time.Duration{1: 10 * ms, 2: 5 * ms}, ticks: 100}
		b := cpuSample{threads: map[int]time.Duration{1: 13 * ms}, ticks: 103}
		require.Equal(t, 30*ms, cpuBetween(a, b))
	})
}

func TestReadCPUReadsThisProcess(t *testing.T) {
	t.Parallel()
	s, err := readCPU(os.Getpid())
	require.NoError(t, err)
	require.NotEmpty(t, s.threads)
	var total time.Duration
	for _, d := range s.threads {
		total += d
	}
	require.Positive(t, total)
}
