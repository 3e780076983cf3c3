package main

import (
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"syscall"
	"time"

	"github.com/tokenbroker/tokenbroker/test/testcluster"
)

// bareProxy is test/cmd/bareproxy, built and started by bench: the
// gateway's listener and upstream settings and nothing else, the
// baseline of the gateway's rows.
type bareProxy struct {
	cmd *exec.Cmd
	url string
	dir string
	// exited is closed once the process has exited.
	exited chan struct{}
}

// startBareProxy builds the bare proxy and starts it as a process of
// its own in front of c's API server, forwarding with token, serving
// with br's serving certificate and verifying lease certificates
// against br's signing CA, as br's gateway does.
func startBareProxy(ctx context.Context, c *testcluster.Cluster, br *brokerProcess, token string) (*bareProxy, error) {
	dir, err := os.MkdirTemp("", "bench-bareproxy-")
	if err != nil {
		return nil, err
	}
	p := &bareProxy{dir: dir}
	fail := func(err error) (*bareProxy, error) {
		p.stop()
		return nil, err
	}
	bin := filepath.Join(dir, "bareproxy")
	if err := buildBareProxy(ctx, bin); err != nil {
		return fail(err)
	}
	tokenFile := filepath.Join(dir, "token")
	if err := os.WriteFile(tokenFile, []byte(token), 0o600); err != nil {
		return fail(err)
	}
	addr := freeAddr()
	p.url = "https://" + addr
	p.cmd = exec.Command(bin, "-listen-address", addr, "-kubeconfig", c.KubeconfigPath, "-token-file", tokenFile,
		"-tls-cert-file", filepath.Join(br.dir, "server.crt"), "-tls-key-file", filepath.Join(br.dir, "server.key"),
		"-client-ca-file", filepath.Join(br.dir, "ca.crt"))
	logPath := filepath.Join(dir, "bareproxy.log")
	logFile, err := os.Create(logPath)
	if err != nil {
		return fail(err)
	}
	defer logFile.Close()
	p.cmd.Stdout, p.cmd.Stderr = logFile, logFile
	p.cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := p.cmd.Start(); err != nil {
		return fail(err)
	}
	p.exited = make(chan struct{})
	go func() { _ = p.cmd.Wait(); close(p.exited) }()
	for start := time.Now(); ; time.Sleep(5 * time.Millisecond) {
		if conn, err := net.Dial("tcp", addr); err == nil {
			conn.Close()
			break
		}
		select {
		case <-p.exited:
			log, _ := os.ReadFile(logPath)
			return fail(fmt.Errorf("the bare proxy exited: %s", log))
		default:
		}
		if time.Since(start) > 30*time.Second || ctx.Err() != nil {
			return fail(fmt.Errorf("the bare proxy is not listening after 30s; log in %s", logPath))
		}
	}
	return p, nil
}

// buildBareProxy builds test/cmd/bareproxy into bin, as make build
// builds the broker: the go command's defaults.
func buildBareProxy(ctx context.Context, bin string) error {
	mod, err := testModuleDir()
	if err != nil {
		return err
	}
	cmd := exec.CommandContext(ctx, "go", "build", "-o", bin, "./cmd/bareproxy")
	cmd.Dir = mod
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("build the bare proxy: %w: %s", err, out)
	}
	return nil
}

// testModuleDir is the test module's directory: test/ at the repository
// root, found from the working directory up, as tokenbrokerBinary finds
// bin/.
func testModuleDir() (string, error) {
	wd, err := os.Getwd()
	if err != nil {
		return "", err
	}
	for d := wd; d != filepath.Dir(d); d = filepath.Dir(d) {
		if _, err := os.Stat(filepath.Join(d, "test", "go.mod")); err == nil {
			return filepath.Join(d, "test"), nil
		}
	}
	return "", fmt.Errorf("no test/go.mod above %s: run bench from the repository", wd)
}

func (p *bareProxy) stop() {
	if p.exited != nil {
		_ = p.cmd.Process.Signal(syscall.SIGTERM)
		<-p.exited
	}
	os.RemoveAll(p.dir)
}
