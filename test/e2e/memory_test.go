package e2e

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/tls"
	"encoding/base32"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"net"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
	"github.com/tokenbroker/tokenbroker/broker/objects"
	"github.com/tokenbroker/tokenbroker/server"
	"github.com/tokenbroker/tokenbroker/test/testcluster"
)

// The memory ceiling of issue 20: the connection caps keep the broker under
// the memory limit the manifests ship while stalled TLS handshakes flood it
// and a peer lists 50,000 leases four times at once.

// shippedMemoryLimitMiB reads the memory limit of the broker container in
// deploy/base (the chart ships the same; a chart test compares them).
func shippedMemoryLimitMiB(t *testing.T) float64 {
	t.Helper()
	m := regexp.MustCompile(`limits:\s*\n\s*memory:\s*(\d+)Mi`).FindStringSubmatch(readDoc(t, "deploy/base/deployment.yaml"))
	require.NotNil(t, m, "deploy/base/deployment.yaml has a memory limit in Mi")
	v, err := strconv.ParseFloat(m[1], 64)
	require.NoError(t, err)
	return v
}

// procStatusMiB reads a field in kB of /proc/PID/status (VmRSS, VmHWM) in
// MiB.
func procStatusMiB(t *testing.T, pid int, field string) float64 {
	t.Helper()
	data, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	require.NoError(t, err)
	for _, line := range strings.Split(string(data), "\n") {
		if v, ok := strings.CutPrefix(line, field+":"); ok {
			kb, err := strconv.ParseFloat(strings.Fields(v)[0], 64)
			require.NoError(t, err)
			return kb / 1024
		}
	}
	t.Fatalf("no %s in /proc/%d/status", field, pid)
	return 0
}

// resetPeakRSS starts VmHWM of pid again from its current RSS (proc(5),
// clear_refs), so that it gives the peak of what follows, seen by the
// kernel rather than by sampling.
func resetPeakRSS(t *testing.T, pid int) {
	t.Helper()
	require.NoError(t, os.WriteFile(fmt.Sprintf("/proc/%d/clear_refs", pid), []byte("5"), 0))
}

// metric sums the samples of name on the broker's /metrics whose labels
// include the given name/value pairs; a series not there yet (a counter
// not yet counted) is 0.
func (e *brokerEnv) metric(t *testing.T, name string, labels ...string) float64 {
	t.Helper()
	status, body, err := e.curl(t, "", "http://"+e.ops+"/metrics")
	require.NoError(t, err)
	require.Equal(t, 200, status)
	v, _ := sumSamples(t, body, name, labels...)
	return v
}

// The flood of stalled handshakes runs in child processes (this test
// binary again, running TestHelperStallHandshakes): one process may hold
// only RLIMIT_NOFILE sockets, whose hard limit may be as low as 20,000,
// which this process, running etcd as well, cannot raise without
// CAP_SYS_RESOURCE.
const (
	stallTargetEnv  = "E2E_STALL_TARGET"  // host:port of the broker's API listener
	stallSourcesEnv = "E2E_STALL_SOURCES" // comma-separated loopback addresses to connect from
	stallConnsEnv   = "E2E_STALL_CONNS"   // connections of each wave
	stallHelloEnv   = "E2E_STALL_HELLO"   // file with the bytes to send first (a ClientHello); none: send nothing
	stallWavesEnv   = "E2E_STALL_WAVES"   // "once": one wave, held until stdin closes; else waves until stdin closes
)

// TestHelperStallHandshakes is not a test: it is the child process of
// startStallFlood. It opens E2E_STALL_CONNS connections spread over the
// source addresses, sends each the ClientHello and never answers the
// server, and reads until the server closes them (at its handshake
// timeout, or at once for a connection over a cap). Then it starts a new
// wave, until its stdin is closed.
func TestHelperStallHandshakes(t *testing.T) {
	target := os.Getenv(stallTargetEnv)
	if target == "" {
		t.Skip("the child process of the stalled-handshake flood")
	}
	n, err := strconv.Atoi(os.Getenv(stallConnsEnv))
	require.NoError(t, err)
	var sources []net.IP
	for _, s := range strings.Split(os.Getenv(stallSourcesEnv), ",") {
		ip := net.ParseIP(s)
		require.True(t, ip != nil && ip.IsLoopback(), "source %q must be a loopback address", s)
		sources = append(sources, ip)
	}
	var hello []byte
	if f := os.Getenv(stallHelloEnv); f != "" {
		hello, err = os.ReadFile(f)
		require.NoError(t, err)
	}
	once := os.Getenv(stallWavesEnv) == "once"
	stop := make(chan struct{})
	go func() {
		_, _ = io.Copy(io.Discard, os.Stdin)
		close(stop)
	}()
	for wave := 1; ; wave++ {
		var wg sync.WaitGroup
		var opened, failed, refusedAtOnce atomic.Int64
		for i := range n {
			wg.Add(1)
			go func() {
				defer wg.Done()
				d := net.Dialer{Timeout: 30 * time.Second, LocalAddr: &net.TCPAddr{IP: sources[i%len(sources)]}}
				conn, err := d.Dial("tcp", target)
				if err != nil {
					failed.Add(1)
					return
				}
				defer conn.Close()
				opened.Add(1)
				start := time.Now()
				if hello != nil {
					_, _ = conn.Write(hello)
				}
				if once {
					<-stop
					return
				}
				// The server ends it; the deadline only guards the test.
				_ = conn.SetReadDeadline(time.Now().Add(time.Minute))
				_, _ = io.Copy(io.Discard, conn)
				if time.Since(start) < 500*time.Millisecond {
					refusedAtOnce.Add(1)
				}
			}()
		}
		wg.Wait()
		fmt.Printf("wave %d: %d opened, %d closed within 0.5s, %d dials failed\n", wave, opened.Load(), refusedAtOnce.Load(), failed.Load())
		select {
		case <-stop:
			return
		default:
		}
		if once {
			return
		}
	}
}

// stallFlood is the running flood: its child processes.
type stallFlood struct {
	cmds   []*exec.Cmd
	stdins []io.WriteCloser
	out    *syncBuffer
	done   chan error
}

// startStallFlood starts children processes that together keep conns
// stalled handshakes coming at target, from sources (loopback addresses),
// sending hello first (nil: nothing). With once, each child opens its
// connections once and holds them open until stop, whatever the server
// does; else it opens them again as soon as the server has closed them
// all.
func startStallFlood(t *testing.T, target string, conns, children int, sources []string, hello []byte, once bool) *stallFlood {
	t.Helper()
	helloFile := ""
	if hello != nil {
		helloFile = writeFile(t, t.TempDir()+"/hello", string(hello))
	}
	waves := "repeat"
	if once {
		waves = "once"
	}
	f := &stallFlood{out: &syncBuffer{}, done: make(chan error, children)}
	for i := range children {
		// Each child connects from its own share of the addresses.
		var mine []string
		for j := i; j < len(sources); j += children {
			mine = append(mine, sources[j])
		}
		cmd := exec.Command(os.Args[0], "-test.run=^TestHelperStallHandshakes$", "-test.count=1", "-test.v")
		cmd.Env = append(os.Environ(), stallTargetEnv+"="+target, stallSourcesEnv+"="+strings.Join(mine, ","),
			stallConnsEnv+"="+strconv.Itoa(conns/children), stallHelloEnv+"="+helloFile, stallWavesEnv+"="+waves)
		stdin, err := cmd.StdinPipe()
		require.NoError(t, err)
		cmd.Stdout, cmd.Stderr = f.out, f.out
		require.NoError(t, cmd.Start())
		go func() { f.done <- cmd.Wait() }()
		f.cmds, f.stdins = append(f.cmds, cmd), append(f.stdins, stdin)
	}
	t.Cleanup(func() {
		for _, c := range f.cmds {
			_ = c.Process.Kill()
		}
	})
	return f
}

// stop ends the flood: each child finishes its wave and exits.
func (f *stallFlood) stop(t *testing.T) {
	t.Helper()
	for _, in := range f.stdins {
		_ = in.Close()
	}
	for range f.cmds {
		select {
		case err := <-f.done:
			require.NoError(t, err, f.out.String())
		case <-time.After(time.Minute):
			t.Fatalf("the flood did not stop:\n%s", f.out.String())
		}
	}
}

// loopbackSources returns n loopback addresses other than 127.0.0.1 (the
// well-behaved peer's): 127.0.1.1, 127.0.1.2, …
func loopbackSources(n int) []string {
	out := make([]string, n)
	for i := range out {
		out[i] = fmt.Sprintf("127.0.%d.%d", 1+i/250, 1+i%250)
	}
	return out
}

var errHelloCaught = errors.New("the ClientHello is caught; no server here")

// helloCatcher is a net.Conn that keeps what a TLS client writes and fails
// its first read: it catches a ClientHello.
type helloCatcher struct{ buf bytes.Buffer }

func (c *helloCatcher) Read([]byte) (int, error)         { return 0, errHelloCaught }
func (c *helloCatcher) Write(p []byte) (int, error)      { return c.buf.Write(p) }
func (c *helloCatcher) Close() error                     { return nil }
func (c *helloCatcher) LocalAddr() net.Addr              { return &net.TCPAddr{} }
func (c *helloCatcher) RemoteAddr() net.Addr             { return &net.TCPAddr{} }
func (c *helloCatcher) SetDeadline(time.Time) error      { return nil }
func (c *helloCatcher) SetReadDeadline(time.Time) error  { return nil }
func (c *helloCatcher) SetWriteDeadline(time.Time) error { return nil }

// clientHello is the first flight of a Go TLS 1.3 client to e's API
// listener, as every client of the broker sends it (post-quantum key share
// included). Sent alone it makes the broker do its half of the handshake
// and wait for a client certificate that never comes.
func clientHello(t *testing.T, e *brokerEnv) []byte {
	t.Helper()
	c := &helloCatcher{}
	err := tls.Client(c, &tls.Config{
		MinVersion: tls.VersionTLS13, ServerName: "127.0.0.1", RootCAs: mustPool(t, e.ca), NextProtos: []string{"h2", "http/1.1"},
	}).Handshake()
	require.ErrorIs(t, err, errHelloCaught)
	require.NotZero(t, c.buf.Len())
	return c.buf.Bytes()
}

// peerClient is an mTLS client as west with one connection of its own,
// opened now.
func (e *brokerEnv) peerClient(t *testing.T) *http.Client {
	t.Helper()
	cl := &http.Client{Timeout: 2 * time.Minute, Transport: &http.Transport{
		TLSClientConfig: e.tlsConfig(t, "west"), ForceAttemptHTTP2: true, MaxConnsPerHost: 1,
	}}
	resp, err := cl.Get("https://" + e.api + "/v1/whoami")
	require.NoError(t, err)
	_, _ = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	require.Equal(t, 200, resp.StatusCode)
	return cl
}

// walkLeases lists all the caller's leases through GET /v1/leases, page by
// page at the largest page size, and counts them.
func walkLeases(ctx context.Context, cl *http.Client, api string) (leases, pages int, err error) {
	token := ""
	for {
		u := "https://" + api + "/v1/leases?limit=1000"
		if token != "" {
			u += "&continue=" + url.QueryEscape(token)
		}
		req, _ := http.NewRequestWithContext(ctx, http.MethodGet, u, nil)
		resp, err := cl.Do(req)
		if err != nil {
			return leases, pages, err
		}
		var list apiv1.LeaseList
		err = json.NewDecoder(resp.Body).Decode(&list)
		// Read to the end, or the connection is not kept for the next
		// page: a new one would wait for a handshake place.
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK || err != nil {
			return leases, pages, fmt.Errorf("page %d: status %d: %v", pages+1, resp.StatusCode, err)
		}
		leases, pages = leases+len(list.Items), pages+1
		if list.Continue == "" {
			return leases, pages, nil
		}
		token = list.Continue
	}
}

// fillLeases issues n leases as west through the broker, at concurrency
// conc, and returns how long it took.
func fillLeases(t *testing.T, e *brokerEnv, n, conc int) time.Duration {
	t.Helper()
	client := e.keptAlive(t)
	defer client.CloseIdleConnections()
	start := time.Now()
	l := runLoad(t, e, client, conc, n, nil)
	require.Empty(t, l.errs)
	require.Empty(t, l.bad)
	require.Equal(t, map[int]int{201: n}, l.statuses)
	return time.Since(start)
}

// cloneLeases adds n leases of template's peer, each a copy of template (a
// lease Secret the broker made) with a lease id of its own: the Secret the
// broker would have written for another issuance, without its
// TokenRequest. The API server takes them several times faster than the
// broker issues (TokenRequest, Secret, patch), which keeps a test with
// 50,000 leases within minutes on 2 cores.
func cloneLeases(t *testing.T, c *testcluster.Cluster, template *corev1.Secret, n, conc int) {
	t.Helper()
	enc := base32.NewEncoding("abcdefghijklmnopqrstuvwxyz234567").WithPadding(base32.NoPadding)
	oldID := template.Labels[objects.LabelLeaseID]
	require.True(t, apiv1.ValidLeaseID(oldID))
	require.True(t, strings.HasSuffix(template.Name, oldID))
	var next atomic.Int64
	var wg sync.WaitGroup
	errs := make(chan error, conc)
	for range conc {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for next.Add(1) <= int64(n) {
				var raw [16]byte
				_, _ = rand.Read(raw[:])
				id := enc.EncodeToString(raw[:])
				s := &corev1.Secret{
					ObjectMeta: metav1.ObjectMeta{
						Name: strings.TrimSuffix(template.Name, oldID) + id, Namespace: template.Namespace,
						Labels: maps.Clone(template.Labels), Annotations: maps.Clone(template.Annotations),
					},
					Type: template.Type, Data: template.Data,
				}
				s.Labels[objects.LabelLeaseID] = id
				if _, err := c.Client.CoreV1().Secrets(s.Namespace).Create(context.Background(), s, metav1.CreateOptions{}); err != nil {
					errs <- err
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	require.NoError(t, <-errs)
}

// leaseSecrets returns the lease Secrets in namespace.
func leaseSecrets(t *testing.T, c *testcluster.Cluster, namespace string) []corev1.Secret {
	t.Helper()
	l, err := c.Client.CoreV1().Secrets(namespace).List(context.Background(), metav1.ListOptions{
		LabelSelector: objects.LabelKind + "=" + objects.LeaseKind,
	})
	require.NoError(t, err)
	return l.Items
}

// TestMemoryStaysUnderTheShippedLimit is issue 20's memory test, not
// timed: with 50,000 live leases, a flood of 20,000 connections that send
// a ClientHello and stall, opened again as soon as the broker has closed
// them, and four parallel walks of all the leases by one peer, the
// broker's peak RSS stays under the memory limit deploy/base and the chart
// ship, with the default connection caps, and a well-behaved peer keeps
// getting kubeconfigs.
//
// The flood comes from 64 loopback addresses, so that it fills the global
// handshake cap and not only each address's: the worst case for memory.
// The peer's clients connected before the flood, as an agent keeps its
// connection: while the handshake cap is full, a new connection is refused
// whoever opens it (docs/operations.md, "Memory").
func TestMemoryStaysUnderTheShippedLimit(t *testing.T) {
	if testing.Short() {
		t.Skip("fills 50,000 leases")
	}
	const leases, flood, sources, listers = 50000, 20000, 64, 4
	limit := shippedMemoryLimitMiB(t)
	c := testcluster.Start(t)
	setUpTarget(t, c)
	e := startLoadBroker(t, c, "--max-live-leases", strconv.Itoa(2*leases), "--log-level", "warn")
	pid := e.proc.cmd.Process.Pid

	// A thousand through the broker, the rest copies of one of them:
	// issuing all 50,000 takes 2.5 to 4 minutes on 2 shared cores.
	const viaBroker = 1000
	took := fillLeases(t, e, viaBroker, 16)
	start := time.Now()
	cloneLeases(t, c, &leaseSecrets(t, c, "argo")[0], leases-viaBroker, 32)
	filled := procStatusMiB(t, pid, "VmHWM")
	t.Logf("issued %d leases in %s, copied %d more in %s; broker RSS %.1f MiB, peak %.1f MiB",
		viaBroker, took.Round(time.Second), leases-viaBroker, time.Since(start).Round(time.Second), procStatusMiB(t, pid, "VmRSS"), filled)

	clients := make([]*http.Client, listers+1)
	for i := range clients {
		clients[i] = e.peerClient(t)
	}
	good := clients[listers]
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	type walk struct {
		leases, pages int
		err           error
	}
	walkAll := func() <-chan walk {
		walks := make(chan walk, listers)
		for i := range listers {
			go func() {
				n, p, err := walkLeases(ctx, clients[i], e.api)
				walks <- walk{n, p, err}
			}()
		}
		return walks
	}

	// The walks alone: what the broker needs besides its connections.
	resetPeakRSS(t, pid)
	walks := walkAll()
	for range listers {
		w := <-walks
		require.NoError(t, w.err)
		require.Equal(t, leases, w.leases, "every lease is listed")
	}
	walksOnly := procStatusMiB(t, pid, "VmHWM")

	// The flood alone, until the handshakes of one full cap have been held
	// to their timeout.
	resetPeakRSS(t, pid)
	f := startStallFlood(t, e.api, flood, 4, loopbackSources(sources), clientHello(t, e), false)
	require.Eventually(t, func() bool {
		return e.metric(t, "tokenbroker_tls_handshake_failures_total", "reason", "timeout") >= server.DefaultMaxHandshakes
	}, 2*time.Minute, 100*time.Millisecond, "the flood fills the handshake cap")
	floodOnly := procStatusMiB(t, pid, "VmHWM")

	// The walks again, under the flood, and the well-behaved peer on its
	// kept connection asking for a kubeconfig now and then.
	resetPeakRSS(t, pid)
	walks = walkAll()
	issued := 0
	every := time.NewTicker(200 * time.Millisecond)
	defer every.Stop()
	for pending := listers; pending > 0; {
		select {
		case w := <-walks:
			pending--
			require.NoError(t, w.err)
			// Each walk sees the leases filled and those issued so far.
			require.GreaterOrEqual(t, w.leases, leases, "every lease is listed")
			require.LessOrEqual(t, w.leases, leases+issued)
		case <-every.C:
			status, body := postWith(t, good, e.api, `{"namespace":"argo","serviceAccount":"runner","ttl":"10m"}`)
			require.Equal(t, http.StatusCreated, status, body)
			issued++
		}
	}
	handshaking := e.metric(t, "tokenbroker_connections_handshaking")
	both := procStatusMiB(t, pid, "VmHWM")
	f.stop(t)

	refused := map[string]float64{}
	for _, r := range server.ConnRefusedReasons() {
		refused[r] = e.metric(t, "tokenbroker_connections_refused_total", "reason", r)
	}
	t.Logf("broker peak RSS: %.1f MiB filling, %.1f MiB with %d parallel walks of %d leases, %.1f MiB with the flood, %.1f MiB with both (limit %.0f MiB)",
		filled, walksOnly, listers, leases, floodOnly, both, limit)
	t.Logf("flood: %.0f handshakes timed out, %.0f in progress at the end, refused %v; the well-behaved peer got %d kubeconfigs during the walks",
		e.metric(t, "tokenbroker_tls_handshake_failures_total", "reason", "timeout"), handshaking, refused, issued)

	for what, peak := range map[string]float64{"filling": filled, "walks": walksOnly, "flood": floodOnly, "flood and walks": both} {
		require.Less(t, peak, limit, "the broker's peak RSS (%s) stays under the shipped memory limit", what)
	}
	require.LessOrEqual(t, handshaking, float64(server.DefaultMaxHandshakes))
	require.Positive(t, issued, "the well-behaved peer was served during the flood")
	require.Positive(t, refused[server.ConnRefusedHandshakes], "the flood was refused over the handshake cap")
}

// postWith sends POST /v1/kubeconfigs with body through cl.
func postWith(t *testing.T, cl *http.Client, api, body string) (int, string) {
	t.Helper()
	req, _ := http.NewRequest(http.MethodPost, "https://"+api+"/v1/kubeconfigs", strings.NewReader(body))
	req.Header.Set("Content-Type", apiv1.MediaTypeJSON)
	resp, err := cl.Do(req)
	require.NoError(t, err)
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

// TestConnectionMemoryCost measures what one connection costs the broker
// in RSS, the figures the default caps are sized from (docs/operations.md,
// "Memory"). It is a measurement, not part of the suite:
//
//	E2E_MEASURE_CONNECTIONS=1 go test ./e2e -run TestConnectionMemoryCost -v
//
// The caps are lifted so that every connection is admitted, and the
// handshake timeout is as long as allowed so that the stalled ones are all
// held at once.
func TestConnectionMemoryCost(t *testing.T) {
	if os.Getenv("E2E_MEASURE_CONNECTIONS") == "" {
		t.Skip("a measurement: set E2E_MEASURE_CONNECTIONS=1")
	}
	const stalled, established = 10000, 2000
	c := testcluster.Start(t)
	setUpTarget(t, c)
	lifted := strconv.Itoa(4 * stalled)
	// A broker of its own for each measurement: Go gives freed memory back
	// to the system only slowly, so one measurement would hide the next.
	broker := func() (*brokerEnv, int, float64) {
		e := startBroker(t, c, "--max-conns", lifted, "--max-handshakes", lifted, "--max-handshakes-per-ip", lifted,
			"--max-conns-per-ip", lifted, "--max-conns-per-identity", lifted, "--handshake-timeout", "4900ms", "--log-level", "warn")
		e.peerClient(t).CloseIdleConnections() // warm up the TLS and HTTP code paths
		pid := e.proc.cmd.Process.Pid
		resetPeakRSS(t, pid)
		return e, pid, procStatusMiB(t, pid, "VmRSS")
	}
	report := func(what string, e *brokerEnv, pid, n int, base float64) {
		peak := procStatusMiB(t, pid, "VmHWM")
		t.Logf("%s: %d connections, RSS %.1f MiB before, peak %.1f MiB: %.1f KiB each (now: Go heap in use %.1f MiB, stacks %.1f MiB)",
			what, n, base, peak, (peak-base)*1024/float64(n),
			e.metric(t, "go_memstats_heap_inuse_bytes")/(1<<20), e.metric(t, "go_memstats_stack_inuse_bytes")/(1<<20))
	}

	for _, tc := range []struct {
		what  string
		hello bool
	}{{"stalled after a ClientHello", true}, {"stalled before a byte", false}} {
		e, pid, base := broker()
		var hello []byte
		if tc.hello {
			hello = clientHello(t, e)
		}
		f := startStallFlood(t, e.api, stalled, 2, loopbackSources(40), hello, true)
		require.Eventually(t, func() bool { return e.metric(t, "tokenbroker_connections_handshaking") >= stalled },
			time.Minute, 50*time.Millisecond, "all handshakes are under way")
		report(tc.what, e, pid, stalled, base)
		f.stop(t)
	}

	for _, h2 := range []bool{true, false} {
		e, pid, base := broker()
		var clients []*http.Client
		proto := ""
		for range established {
			tr := &http.Transport{TLSClientConfig: e.tlsConfig(t, "west"), ForceAttemptHTTP2: h2}
			if !h2 {
				tr.TLSClientConfig.NextProtos = []string{"http/1.1"}
			}
			cl := &http.Client{Timeout: time.Minute, Transport: tr}
			resp, err := cl.Get("https://" + e.api + "/v1/whoami")
			require.NoError(t, err)
			_, _ = io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			clients = append(clients, cl)
			proto = resp.Proto
		}
		report(fmt.Sprintf("idle after a request (client offers h2: %v, got %s)", h2, proto), e, pid, established, base)
		for _, cl := range clients {
			cl.CloseIdleConnections()
		}
	}
}
