package testcluster

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"time"
)

// logTailBytes is how much of a child's log a start error carries.
const logTailBytes = 8192

// process is a child process (kube-apiserver, kube-controller-manager) whose
// output goes to a log file.
type process struct {
	name    string
	logPath string
	cmd     *exec.Cmd
	log     *os.File
	done    chan struct{} // closed once the process has been reaped
	waitErr error         // valid after done is closed
}

// startProcess starts bin with args, appending its output to logPath (so a
// restarted process continues the same log).
//
// The child gets its own process group (so a terminal's Ctrl-C reaches only
// us, and Stop can signal the whole group) and SIGKILL as parent-death
// signal, so that it never outlives the test process, even one killed with
// SIGKILL. (Pdeathsig follows the OS thread that forked; Go only retires
// threads of goroutines that exit while locked to them, which this package
// never does.)
func startProcess(name, bin string, args []string, logPath string) (*process, error) {
	logFile, err := os.OpenFile(logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return nil, fmt.Errorf("open %s log: %w", name, err)
	}
	cmd := exec.Command(bin, args...)
	cmd.Stdout = logFile
	cmd.Stderr = logFile
	cmd.Env = os.Environ()
	cmd.SysProcAttr = &syscall.SysProcAttr{
		Setpgid:   true,
		Pdeathsig: syscall.SIGKILL,
	}
	if err := cmd.Start(); err != nil {
		_ = logFile.Close()
		return nil, fmt.Errorf("start %s: %w", name, err)
	}
	p := &process{name: name, logPath: logPath, cmd: cmd, log: logFile, done: make(chan struct{})}
	go func() {
		p.waitErr = cmd.Wait()
		_ = logFile.Close()
		close(p.done)
	}()
	return p, nil
}

// exited reports whether the process has ended, and why.
func (p *process) exited() (bool, error) {
	select {
	case <-p.done:
		if p.waitErr == nil {
			return true, errors.New("exited with status 0")
		}
		return true, p.waitErr
	default:
		return false, nil
	}
}

// stop sends SIGTERM to the process group, and SIGKILL if the process is
// still there after timeout. It returns once the process has been reaped.
// A process that was already gone is not an error.
func (p *process) stop(timeout time.Duration) error {
	select {
	case <-p.done:
		return nil
	default:
	}
	pgid := p.cmd.Process.Pid // Setpgid: the group id is the child's pid.
	if err := syscall.Kill(-pgid, syscall.SIGTERM); err != nil && !errors.Is(err, syscall.ESRCH) {
		return fmt.Errorf("signal %s: %w", p.name, err)
	}
	timer := time.NewTimer(timeout)
	defer timer.Stop()
	select {
	case <-p.done:
		// Reap nothing more: the leader exited; kill stragglers of its group.
		_ = syscall.Kill(-pgid, syscall.SIGKILL)
		return nil
	case <-timer.C:
	}
	if err := syscall.Kill(-pgid, syscall.SIGKILL); err != nil && !errors.Is(err, syscall.ESRCH) {
		return fmt.Errorf("kill %s: %w", p.name, err)
	}
	// A process that SIGKILL does not end is stuck in the kernel (a frozen
	// cgroup, an uninterruptible wait): say where, rather than wait for it
	// for ever.
	select {
	case <-p.done:
	case <-time.After(killTimeout):
		return fmt.Errorf("%s did not exit within %s of SIGKILL: %s", p.name, killTimeout, kernelState(pgid))
	}
	return fmt.Errorf("%s did not exit within %s of SIGTERM and was killed", p.name, timeout)
}

// killTimeout is how long stop waits for a process it killed with SIGKILL.
const killTimeout = 10 * time.Second

// kernelState describes where the kernel holds process pid: its state and
// the function it waits in.
func kernelState(pid int) string {
	status, _ := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	wchan, _ := os.ReadFile(fmt.Sprintf("/proc/%d/wchan", pid))
	state := "?"
	for _, l := range strings.Split(string(status), "\n") {
		if v, ok := strings.CutPrefix(l, "State:"); ok {
			state = strings.TrimSpace(v)
		}
	}
	return fmt.Sprintf("pid %d state %s, waiting in %q", pid, state, string(wchan))
}

// logTail returns the end of the process's log, for error messages.
func (p *process) logTail() string {
	return readTail(p.logPath, logTailBytes)
}

// notReady stops p, which did not come up (err says how), and returns
// err as what failed with the end of p's log. A log that says the
// process's address was in use marks the error errPortInUse, so that the
// caller starts it again on another port.
func (p *process) notReady(stopTimeout time.Duration, what string, err error) error {
	_ = p.stop(stopTimeout)
	tail := p.logTail()
	if strings.Contains(tail, "address already in use") {
		err = fmt.Errorf("%w: %w", errPortInUse, err)
	}
	return fmt.Errorf("%s: %w\n--- tail of %s ---\n%s", what, err, filepath.Base(p.logPath), tail)
}

// readTail returns at most the last n bytes of the file at path.
func readTail(path string, n int64) string {
	f, err := os.Open(path)
	if err != nil {
		return fmt.Sprintf("(cannot read %s: %v)", path, err)
	}
	defer func() { _ = f.Close() }()
	fi, err := f.Stat()
	if err != nil {
		return fmt.Sprintf("(cannot stat %s: %v)", path, err)
	}
	off := fi.Size() - n
	if off < 0 {
		off = 0
	}
	b, err := io.ReadAll(io.NewSectionReader(f, off, fi.Size()-off))
	if err != nil {
		return fmt.Sprintf("(cannot read %s: %v)", path, err)
	}
	if off > 0 {
		// Drop the partial first line.
		if i := bytes.IndexByte(b, '\n'); i >= 0 {
			b = b[i+1:]
		}
	}
	return string(b)
}
