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

// baseline is a command of test/cmd built and started by bench as a
// process of its own beside the broker's, so that the CPU of each is its
// own: the bare proxy (the gateway's rows' baseline) or the bare issuer
// (the issuance rows').
type baseline struct {
	cmd *exec.Cmd
	url string
	dir string
	// exited is closed once the process has exited.
	exited chan struct{}
}

// startBareProxy starts test/cmd/bareproxy in front of c's API server,
// forwarding with token, serving with br's serving certificate and
// verifying lease certificates against br's signing CA, as br's gateway
// does.
func startBareProxy(ctx context.Context, c *testcluster.Cluster, br *brokerProcess, token string) (*baseline, error) {
	return startBaseline(ctx, "bareproxy", func(dir, addr string) ([]string, error) {
		tokenFile := filepath.Join(dir, "token")
		if err := os.WriteFile(tokenFile, []byte(token), 0o600); err != nil {
			return nil, err
		}
		return []string{"-listen-address", addr, "-kubeconfig", c.KubeconfigPath, "-token-file", tokenFile,
			"-tls-cert-file", filepath.Join(br.dir, "server.crt"), "-tls-key-file", filepath.Join(br.dir, "server.key"),
			"-client-ca-file", filepath.Join(br.dir, "ca.crt")}, nil
	})
}

// startBareIssuer starts test/cmd/bareissuer in front of c's API server,
// calling it with c's admin kubeconfig and the broker's client limits,
// serving with br's serving certificate and verifying client
// certificates against br's CA, as br's API does: br's client reaches it
// unchanged.
func startBareIssuer(ctx context.Context, c *testcluster.Cluster, br *brokerProcess) (*baseline, error) {
	return startBaseline(ctx, "bareissuer", func(_, addr string) ([]string, error) {
		return []string{"-listen-address", addr, "-kubeconfig", c.KubeconfigPath,
			"-tls-cert-file", filepath.Join(br.dir, "server.crt"), "-tls-key-file", filepath.Join(br.dir, "server.key"),
			"-client-ca-file", filepath.Join(br.dir, "ca.crt"),
			fmt.Sprintf("-kube-qps=%d", brokerKubeQPS), fmt.Sprintf("-kube-burst=%d", brokerKubeBurst)}, nil
	})
}

// startBaseline builds test/cmd/<name> and starts it with the arguments
// args gives for its temporary directory and listen address, and waits
// until it listens.
func startBaseline(ctx context.Context, name string, args func(dir, addr string) ([]string, error)) (*baseline, error) {
	dir, err := os.MkdirTemp("", "bench-"+name+"-")
	if err != nil {
		return nil, err
	}
	p := &baseline{dir: dir}
	fail := func(err error) (*baseline, error) {
		p.stop()
		return nil, err
	}
	bin := filepath.Join(dir, name)
	if err := buildTestCommand(ctx, name, bin); err != nil {
		return fail(err)
	}
	addr := freeAddr()
	argv, err := args(dir, addr)
	if err != nil {
		return fail(err)
	}
	p.url = "https://" + addr
	p.cmd = exec.Command(bin, argv...)
	logPath := filepath.Join(dir, name+".log")
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
			return fail(fmt.Errorf("%s exited: %s", name, log))
		default:
		}
		if time.Since(start) > 30*time.Second || ctx.Err() != nil {
			return fail(fmt.Errorf("%s is not listening after 30s; log in %s", name, logPath))
		}
	}
	return p, nil
}

// buildTestCommand builds test/cmd/<name> into bin, as make build builds
// the broker: the go command's defaults.
func buildTestCommand(ctx context.Context, name, bin string) error {
	mod, err := testModuleDir()
	if err != nil {
		return err
	}
	cmd := exec.CommandContext(ctx, "go", "build", "-o", bin, "./cmd/"+name)
	cmd.Dir = mod
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("build %s: %w: %s", name, err, out)
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

func (p *baseline) stop() {
	if p.exited != nil {
		_ = p.cmd.Process.Signal(syscall.SIGTERM)
		<-p.exited
	}
	os.RemoveAll(p.dir)
}
