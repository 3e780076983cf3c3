package testcluster

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"net"
	"net/http"
	"path/filepath"
	"strconv"
	"strings"
	"time"
)

const kcmLogFile = "kube-controller-manager.log"

// ControllerManagerLogPath is the kube-controller-manager's log file (in Dir,
// so gone after Stop). It exists only with WithControllerManager.
func (c *Cluster) ControllerManagerLogPath() string {
	return filepath.Join(c.Dir, kcmLogFile)
}

// startControllerManager starts kube-controller-manager with only the
// configured controllers and waits for its /healthz.
func (c *Cluster) startControllerManager(ctx context.Context) error {
	controllers := c.opts.controllers
	if len(controllers) == 0 {
		controllers = DefaultControllers()
	}
	for attempt := 1; ; attempt++ {
		port, err := freePort()
		if err != nil {
			return err
		}
		err = c.startControllerManagerOn(ctx, port, controllers)
		if err == nil {
			return nil
		}
		if !errors.Is(err, errPortInUse) || attempt == portBindRetries {
			return err
		}
	}
}

func (c *Cluster) startControllerManagerOn(ctx context.Context, port int, controllers []string) error {
	file := func(name string) string { return filepath.Join(c.Dir, name) }
	args := []string{
		"--kubeconfig=" + c.KubeconfigPath,
		"--authentication-kubeconfig=" + c.KubeconfigPath,
		"--authorization-kubeconfig=" + c.KubeconfigPath,
		"--controllers=" + strings.Join(controllers, ","),
		// The cluster CA signs CSRs, so issued client certificates
		// authenticate to this API server (--client-ca-file).
		"--cluster-signing-cert-file=" + file(caCertFile),
		"--cluster-signing-key-file=" + file(caKeyFile),
		// What the root CA publisher puts in every namespace's
		// kube-root-ca.crt (the CA of the API server's serving
		// certificate), and the key of the legacy token controller.
		"--root-ca-file=" + file(caCertFile),
		"--service-account-private-key-file=" + file(saPrivateKeyFile),
		"--leader-elect=false",
		"--bind-address=127.0.0.1",
		"--secure-port=" + strconv.Itoa(port),
		"--cert-dir=" + file("kcm-certs"),
		"--profiling=false",
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	p, err := startProcess(KubeControllerManager, c.kcmBin, args, c.ControllerManagerLogPath())
	if err != nil {
		return err
	}
	if err := waitForHealthz(ctx, p, port); err != nil {
		return p.notReady(c.opts.stopTimeout, "kube-controller-manager not healthy", err)
	}
	c.kcm = p
	return nil
}

// waitForHealthz polls the controller manager's /healthz (allowed
// anonymously) until it answers 200, p exits or ctx ends.
func waitForHealthz(ctx context.Context, p *process, port int) error {
	client := &http.Client{
		Timeout: probeTimeout,
		Transport: &http.Transport{
			// Its serving certificate is self-signed in --cert-dir; the probe
			// only asks whether it is up, over loopback.
			TLSClientConfig: &tls.Config{InsecureSkipVerify: true}, //nolint:gosec // loopback health probe of a test process
		},
	}
	defer client.CloseIdleConnections()
	url := "https://" + net.JoinHostPort("127.0.0.1", strconv.Itoa(port)) + "/healthz"
	var last error
	for {
		if gone, err := p.exited(); gone {
			return fmt.Errorf("process exited: %w", err)
		}
		last = probeOnce(ctx, client, url)
		if last == nil {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("%w; last /healthz: %w", ctx.Err(), last)
		case <-time.After(pollInterval):
		}
	}
}

func probeOnce(ctx context.Context, client *http.Client, url string) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return fmt.Errorf("build request: %w", err)
	}
	resp, err := client.Do(req)
	if err != nil {
		return err
	}
	_ = resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("status %s", resp.Status)
	}
	return nil
}
