//go:build node

package e2e

import (
	"bufio"
	"context"
	"encoding/json"
	"io"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"k8s.io/client-go/tools/clientcmd"

	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
	"github.com/tokenbroker/tokenbroker/test/testcluster"
)

// TestNodeStreamsEndAtRevocationThroughTheGateway is the other side of
// TestNodeStreamsOutliveARevocationInDirectMode, on a real kubelet: with a
// gateway lease (a grant with access: gateway), exec over WebSocket
// (kubectl's default) and over SPDY, attach, and port-forward over
// WebSocket (the default) and over SPDY all pass through the broker's
// lease gateway, and all of them end when the lease is revoked, each
// within a bound of the DELETE's answer; kubectl exits, and a new request
// with the lease is refused.
func TestNodeStreamsEndAtRevocationThroughTheGateway(t *testing.T) {
	const bound = 2 * time.Second // from the DELETE's answer to a stream's end
	const idle = 12 * time.Second // the streams' pause before the revocation
	c := testcluster.Start(t, testcluster.WithNode())
	setUpTarget(t, c)
	ctx := t.Context()
	kubectl := kubectlBinary(t)
	grantPodStreams(t, c)
	startProbePod(t, c, kubectl, "argo", "probe")

	e, gatewayURL := startBrokerWithGateway(t, c, `      - namespaces: [argo]
        serviceAccounts: [runner]
        maxTTL: 12h
        access: gateway
`)
	west := filepath.Join(e.dir, "west")
	status, body := e.postKubeconfig(t, west, `{"namespace":"argo","serviceAccount":"runner","ttl":"1h"}`)
	require.Equal(t, 201, status, body)
	var lease apiv1.KubeconfigResponse
	require.NoError(t, json.Unmarshal([]byte(body), &lease))
	require.Equal(t, apiv1.AccessGateway, lease.Access, "the grant's mode")
	require.Empty(t, lease.Token, "no Kubernetes token leaves the broker")
	cfg, err := clientcmd.RESTConfigFromKubeConfig([]byte(lease.Kubeconfig))
	require.NoError(t, err)
	require.Equal(t, gatewayURL, cfg.Host, "the kubeconfig points at the gateway")
	kc := writeFile(t, filepath.Join(t.TempDir(), "lease.kubeconfig"), lease.Kubeconfig)
	withLease := func(args ...string) []string { return append([]string{"--kubeconfig", kc, "-n", "argo"}, args...) }

	// kubectl's defaults first (WebSocket), then SPDY, as kubectl before
	// 1.31 (exec, attach) and 1.30 (port-forward) spoke it.
	execWS := startStream(t, kubectl, withLease("exec", "-i", "probe", "--", "/nodeprobe", "cat")...)
	attach := startStream(t, kubectl, withLease("attach", "-i", "probe")...)
	pfWS := startWatchedPortForward(t, kubectl, withLease("port-forward", "pod/probe", ":8080")...)
	t.Setenv("KUBECTL_REMOTE_COMMAND_WEBSOCKETS", "false")
	t.Setenv("KUBECTL_PORT_FORWARD_WEBSOCKETS", "false")
	execSPDY := startStream(t, kubectl, withLease("exec", "-i", "probe", "--", "/nodeprobe", "cat")...)
	pfSPDY := startWatchedPortForward(t, kubectl, withLease("port-forward", "pod/probe", ":8080")...)
	connWS, connSPDY := pfWS.dial(t), pfSPDY.dial(t)
	echoers := map[string]interface{ echo(string) error }{
		"exec (WebSocket)": execWS, "exec (SPDY)": execSPDY, "attach (WebSocket)": attach,
		"port-forward (WebSocket)": connWS, "port-forward (SPDY)": connSPDY,
	}
	for name, s := range echoers {
		require.NoError(t, s.echo("before the revocation"), name)
	}
	require.GreaterOrEqual(t, gatewayConnCount(t, e), 5.0, "every stream holds a connection of the gateway")
	// Left unused for longer than client-go's ping periods (5 s exec and
	// attach, 10 s port-forward), they still work: what ends them below is
	// the revocation, not a timeout of the gateway.
	time.Sleep(idle)
	for name, s := range echoers {
		require.NoError(t, s.echo("after a pause"), "%s, unused for %s", name, idle)
	}

	// Each end is stamped as it happens, not as it is looked at.
	streams := []struct {
		name string
		end  <-chan time.Time
	}{
		{"exec (WebSocket)", stampEnd(execWS.done)},
		{"exec (SPDY)", stampEnd(execSPDY.done)},
		{"attach (WebSocket)", stampEnd(attach.done)},
		{"port-forward (WebSocket)", stampEnd(pfWS.done)},
		{"a connection through it (WebSocket)", stampEnd(closedAtEOF(t, connWS))},
		{"port-forward (SPDY)", stampEnd(pfSPDY.done)},
		{"a connection through it (SPDY)", stampEnd(closedAtEOF(t, connSPDY))},
	}
	sent := time.Now()
	status, body, err = e.curl(t, west, "-X", "DELETE", "https://"+e.api+"/v1/leases/"+lease.LeaseID)
	require.NoError(t, err, body)
	require.Equal(t, 204, status, body)
	answered := time.Now()

	// All are measured before any is judged, so that the log shows every
	// one; 10 s is long enough to measure an end past the bound. A
	// negative time is an end before curl had the answer: the gateway
	// learns of the revocation from its watch of the lease Secrets, which
	// can beat the answer to curl.
	waitUntil := answered.Add(10 * time.Second)
	report := make([]string, len(streams))
	took := make([]time.Duration, len(streams))
	ended := make([]bool, len(streams))
	for i, s := range streams {
		select {
		case end := <-s.end:
			took[i], ended[i] = end.Sub(answered), true
			report[i] = took[i].Round(time.Millisecond).String()
		case <-time.After(time.Until(waitUntil)):
			report[i] = "still open after 10s"
		}
	}
	named := make([]string, len(streams))
	for i, s := range streams {
		named[i] = s.name + " " + report[i]
	}
	t.Logf("the DELETE took %s; from its answer to each stream's end: %s", answered.Sub(sent).Round(time.Millisecond), strings.Join(named, ", "))
	for i, s := range streams {
		require.True(t, ended[i] && took[i] < bound, "%s: %s (bound %s)", s.name, report[i], bound)
	}

	// The gateway holds none of the lease's connections any more, and a new
	// request with the lease is refused.
	require.Eventually(t, func() bool { return gatewayConnCount(t, e) == 0 }, 5*time.Second, 20*time.Millisecond,
		"the gateway still counts connections of the revoked lease")
	out, err := exec.CommandContext(ctx, kubectl, withLease("exec", "probe", "--", "/nodeprobe", "cat")...).CombinedOutput()
	require.Error(t, err, "a new exec is refused: %s", out)
	require.Contains(t, string(out), "the lease is revoked or expired")

	// The broker's audit has each stream as a request of the lease it
	// forwarded (written as the stream ends): WebSocket upgrades are GETs,
	// SPDY ones POSTs. And the gateway says it ended the lease's
	// connections because it was revoked.
	want := []string{"GET attach", "GET exec", "GET portforward", "POST exec", "POST portforward"} // sorted
	require.Eventually(t, func() bool {
		var got []string
		closed := false
		for _, ev := range e.auditEvents(t) {
			if ev["lease_id"] != lease.LeaseID {
				continue
			}
			switch ev["action"] {
			case "gateway_request":
				if sub, ok := strings.CutPrefix(ev["path"], "/api/v1/namespaces/argo/pods/probe/"); ok && ev["decision"] == "allow" {
					got = append(got, ev["method"]+" "+sub)
				}
			case "gateway_close":
				closed = closed || ev["reason"] == "revoked"
			}
		}
		slices.Sort(got)
		return closed && slices.Equal(want, got)
	}, 5*time.Second, 20*time.Millisecond, "the audit names every stream the gateway forwarded, and the revocation that ended them")
}

// stampEnd sends the time done closes.
func stampEnd(done <-chan struct{}) <-chan time.Time {
	at := make(chan time.Time, 1)
	go func() {
		<-done
		at <- time.Now()
	}()
	return at
}

// closedAtEOF returns a channel closed when the connection through the
// port-forward reads its end. Nothing else reads it from now on.
func closedAtEOF(t *testing.T, c *echoConn) <-chan struct{} {
	t.Helper()
	done := make(chan struct{})
	require.NoError(t, c.c.SetDeadline(time.Time{})) // echo's deadline would end the read
	go func() {
		defer close(done)
		_, _ = io.Copy(io.Discard, c.r)
	}()
	return done
}

// watchedPortForward is a running kubectl port-forward whose exit is
// seen (done).
type watchedPortForward struct {
	*portForward
	done chan struct{} // closed when kubectl has exited
}

// startWatchedPortForward is startPortForward that also tells when kubectl
// exits.
func startWatchedPortForward(t *testing.T, kubectl string, args ...string) *watchedPortForward {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	cmd := exec.CommandContext(ctx, kubectl, args...)
	stdout, err := cmd.StdoutPipe()
	require.NoError(t, err)
	require.NoError(t, cmd.Start())
	pf := &watchedPortForward{done: make(chan struct{})}
	t.Cleanup(func() {
		cancel()
		<-pf.done
	})
	ports := make(chan string, 1)
	go func() {
		defer close(pf.done)
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			if m := forwardingFrom.FindStringSubmatch(sc.Text()); m != nil {
				select {
				case ports <- m[1]:
				default:
				}
			}
		}
		_ = cmd.Wait()
	}()
	select {
	case p := <-ports:
		pf.portForward = &portForward{port: p}
		return pf
	case <-pf.done:
		t.Fatal("kubectl port-forward exited before it forwarded")
	case <-time.After(30 * time.Second):
		t.Fatal("kubectl port-forward did not say which port it forwards")
	}
	return nil
}
