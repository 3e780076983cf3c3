package execcred

import (
	"bytes"
	"path/filepath"
	"strconv"

	"github.com/tokenbroker/tokenbroker/pki"
)

// Parent is the process that ran the plugin: kubectl, or a controller
// built on client-go. The cache records whom it handed a credential to,
// to tell a credential the API server refused (see Plugin).
type Parent struct {
	// PID is the parent's process id; 0 means unknown, and then nothing is
	// recorded or compared.
	PID int `json:"pid"`
	// StartTime is when the parent started, in clock ticks after boot
	// (field 22 of /proc/<pid>/stat), so that a process that later gets the
	// same PID is not taken for the parent. 0 if it could not be read.
	StartTime uint64 `json:"startTime,omitempty"`
}

// Known reports whether p names a process.
func (p Parent) Known() bool { return p.PID > 0 }

// maxStatBytes bounds /proc/<pid>/stat: 52 numbers and a command name of at
// most 64 bytes.
const maxStatBytes = 4 << 10

// ParentOf describes the process pid (the caller passes os.Getppid()) with
// its start time read from procDir ("/proc"). Where there is no such file
// (not Linux, or /proc hidden) the start time stays 0: a reused PID may
// then be taken for the parent, which costs one extra issuance, never a
// refused credential handed out again.
func ParentOf(procDir string, pid int) Parent {
	if pid <= 1 {
		// Orphaned: the parent is gone and init adopted the plugin.
		return Parent{}
	}
	p := Parent{PID: pid}
	data, err := pki.ReadFileLimit(filepath.Join(procDir, strconv.Itoa(pid), "stat"), maxStatBytes)
	if err == nil {
		p.StartTime, _ = parseStatStartTime(data)
	}
	return p
}

// parseStatStartTime reads field 22 (starttime) of a /proc/<pid>/stat
// line. Field 2 is the command name in parentheses, which may itself hold
// spaces and parentheses, so the fields are counted after its last ')'.
func parseStatStartTime(data []byte) (uint64, bool) {
	i := bytes.LastIndexByte(data, ')')
	if i < 0 {
		return 0, false
	}
	fields := bytes.Fields(data[i+1:])
	const startTimeField = 22 - 3 // fields[0] is field 3, the state
	if len(fields) <= startTimeField {
		return 0, false
	}
	v, err := strconv.ParseUint(string(fields[startTimeField]), 10, 64)
	if err != nil {
		return 0, false
	}
	return v, true
}
