package server

import (
	"net/http"
	"os"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	clocktesting "k8s.io/utils/clock/testing"
)

// TestAShutdownDelayKeepsServingWhileReadyzSaysDraining: after SIGTERM
// (Run's context cancelled) the listeners stay open for ShutdownDelay, so
// that new connections that the Service still routes here are served,
// with /readyz 503 and Connection: close; then they close.
func TestAShutdownDelayKeepsServingWhileReadyzSaysDraining(t *testing.T) {
	t.Parallel()
	clk := clocktesting.NewFakeClock(time.Now())
	r := startServer(t, &fakeBroker{}, nil, func(c *Config) { c.ShutdownDelay = time.Minute; c.Clock = clk })
	t.Cleanup(func() { clk.Step(time.Hour) }) // before startServer's, which waits for Run
	r.cancel()
	require.Eventually(t, func() bool {
		resp, err := http.Get(r.opsURL("/readyz"))
		if err != nil {
			return false
		}
		defer func() { _ = resp.Body.Close() }()
		return resp.StatusCode == http.StatusServiceUnavailable
	}, 5*time.Second, 10*time.Millisecond)
	require.Eventually(t, clk.HasWaiters, 5*time.Second, time.Millisecond)

	http1 := r.client(r.goodClientCert(t))
	http1.Transport.(*http.Transport).ForceAttemptHTTP2 = false // Connection: close is HTTP/1.1's
	resp, err := http1.Get(r.apiURL("/v1/whoami"))
	require.NoError(t, err, "a new connection is still served during the delay")
	_ = resp.Body.Close()
	require.Equal(t, http.StatusOK, resp.StatusCode)
	require.True(t, resp.Close, "with Connection: close, so that the peer's next request opens a connection elsewhere")
	select {
	case <-r.finished:
		t.Fatal("Run returned before the delay")
	default:
	}

	clk.Step(time.Minute)
	require.NoError(t, r.wait(t))
	_, err = r.client(r.goodClientCert(t)).Get(r.apiURL("/v1/whoami"))
	require.Error(t, err, "closed after the delay")
}

// TestWithReusePortASuccessorTakesOverWithoutARefusedConnection runs two
// servers on the same ports, as the chart's hostNetwork Pods of one node
// do during a rolling update: the old one, told to stop, keeps serving
// until the new one answers /readyz on the shared operations port, then
// closes its listeners. A client that opens a new connection for every
// request all along sees no error.
func TestWithReusePortASuccessorTakesOverWithoutARefusedConnection(t *testing.T) {
	t.Parallel()
	migrates := migrateQueuedConnections()
	clk := clocktesting.NewFakeClock(time.Now()) // never stepped: only a successor ends the delay
	old := startServer(t, &fakeBroker{}, nil, func(c *Config) {
		c.Addr, c.OpsAddr, c.ReusePort, c.ShutdownDelay, c.Clock = "127.0.0.1:0", "127.0.0.1:0", true, time.Minute, clk
	})
	t.Cleanup(func() { clk.Step(time.Hour) }) // a failed test still lets Run return
	cert := old.goodClientCert(t)
	var served, failed atomic.Int64
	var lastErr atomic.Value
	stop := make(chan struct{})
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			select {
			case <-stop:
				return
			default:
			}
			client := old.client(cert)
			client.Transport.(*http.Transport).DisableKeepAlives = true
			resp, err := client.Get(old.apiURL("/v1/whoami"))
			if err != nil {
				if !migrates && strings.Contains(err.Error(), "connect: connection reset by peer") {
					continue // the kernel's, documented: without tcp_migrate_req it resets a queued connection
				}
				failed.Add(1)
				lastErr.Store(err.Error())
				continue
			}
			_ = resp.Body.Close()
			if resp.StatusCode != http.StatusOK {
				failed.Add(1)
				lastErr.Store(resp.Status)
				continue
			}
			served.Add(1)
		}
	}()
	require.Eventually(t, func() bool { return served.Load() > 10 }, 5*time.Second, time.Millisecond)

	old.cancel()
	require.Eventually(t, clk.HasWaiters, 5*time.Second, time.Millisecond, "draining, waiting for a successor")
	before := served.Load()
	require.Eventually(t, func() bool { return served.Load() > before+10 }, 5*time.Second, time.Millisecond,
		"the old server serves on while no successor listens")

	successor := startServer(t, &fakeBroker{}, nil, func(c *Config) {
		c.Addr, c.OpsAddr, c.ReusePort = old.srv.Addr().String(), old.srv.OpsAddr().String(), true
		c.TLSConfig = old.pki.serverTLSConfig(t)
	})
	require.NoError(t, old.wait(t), "the old server closes once its successor serves")
	require.NotEmpty(t, old.logs.FilterMessage("a successor serves on the shared ports; closing the listeners").All())
	before = served.Load()
	require.Eventually(t, func() bool { return served.Load() > before+10 }, 5*time.Second, time.Millisecond,
		"the successor alone serves")
	close(stop)
	<-done
	require.Zero(t, failed.Load(), "no request failed over the handover (%d served; last error %v)", served.Load(), lastErr.Load())
	require.NotEqual(t, old.srv.instance, successor.srv.instance)
}

// tcpMigrateReq is the sysctl that makes Linux hand the connections queued
// on a closing SO_REUSEPORT socket to another socket of the port instead of
// resetting them (docs/operations.md asks it of nodes that run the broker
// on their network).
const tcpMigrateReq = "/proc/sys/net/ipv4/tcp_migrate_req"

// migrateQueuedConnections sets tcpMigrateReq where it can (as root; it is
// left set, as on such a node, so that parallel tests do not undo each
// other's) and reports whether it is set.
func migrateQueuedConnections() bool {
	if b, err := os.ReadFile(tcpMigrateReq); err == nil && strings.TrimSpace(string(b)) == "1" {
		return true
	}
	return os.WriteFile(tcpMigrateReq, []byte("1"), 0o644) == nil
}
