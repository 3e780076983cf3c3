package server

import (
	"fmt"
	"os"
	"os/signal"
	"sync"
	"syscall"

	"go.uber.org/zap"

	"github.com/tokenbroker/tokenbroker/broker/audit"
)

// The Options.AuditLog values that are not file paths.
const (
	AuditStdout = "stdout"
	AuditStderr = "stderr"
)

// OpenAuditLog opens the audit sink named by dest (AuditStdout,
// AuditStderr or a file path); the returned function closes a file sink. A
// file sink is created 0600, appended to, and reopened on SIGHUP until it
// is closed, so that logrotate's rename-and-signal rotation loses no event.
func OpenAuditLog(dest string, log *zap.Logger) (audit.Auditor, func(), error) {
	switch dest {
	case AuditStdout:
		return audit.NewLog(os.Stdout), func() {}, nil
	case AuditStderr:
		return audit.NewLog(os.Stderr), func() {}, nil
	case "":
		return nil, nil, fmt.Errorf("audit log: %q, %q or a file path is required", AuditStdout, AuditStderr)
	}
	f, err := openAuditFile(dest)
	if err != nil {
		return nil, nil, err
	}
	hup := make(chan os.Signal, 1)
	signal.Notify(hup, syscall.SIGHUP)
	stop, done := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(done)
		for {
			select {
			case <-stop:
				return
			case <-hup:
				if err := f.reopen(); err != nil {
					log.Error("audit log not reopened; still writing to the old file", zap.String("file", dest), zap.Error(err))
					continue
				}
				log.Info("audit log reopened", zap.String("file", dest))
			}
		}
	}()
	return audit.NewLog(f), func() {
		signal.Stop(hup)
		close(stop)
		<-done
		_ = f.close()
	}, nil
}

// auditFile is an audit log file that can be reopened under the same
// name. Each event is one Write with O_APPEND, so a line is never split
// between the old file and the new one.
type auditFile struct {
	path string
	mu   sync.Mutex
	f    *os.File
}

func openAuditFile(path string) (*auditFile, error) {
	a := &auditFile{path: path}
	if err := a.reopen(); err != nil {
		return nil, err
	}
	return a, nil
}

func (a *auditFile) Write(p []byte) (int, error) {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.f.Write(p)
}

// reopen opens the path again (created 0600 if it was moved away) and
// closes the old file; on failure the old file stays in use.
func (a *auditFile) reopen() error {
	f, err := os.OpenFile(a.path, os.O_WRONLY|os.O_APPEND|os.O_CREATE, 0o600)
	if err != nil {
		return fmt.Errorf("audit log: %w", err)
	}
	a.mu.Lock()
	old := a.f
	a.f = f
	a.mu.Unlock()
	if old != nil {
		_ = old.Close()
	}
	return nil
}

func (a *auditFile) close() error {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.f.Close()
}
