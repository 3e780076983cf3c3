package gateway

import (
	"bufio"
	"context"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.uber.org/zap"
	"k8s.io/apimachinery/pkg/types"
	clocktesting "k8s.io/utils/clock/testing"

	"github.com/tokenbroker/tokenbroker/broker/audit"
	"github.com/tokenbroker/tokenbroker/pki"
)

// fakeLeases is the lease counter's memory, by leaseKey.
type fakeLeases struct {
	mu   sync.Mutex
	live map[string]time.Time
}

func (f *fakeLeases) Holds(namespace, name string, uid types.UID, _ string, now time.Time) (time.Time, bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	exp, ok := f.live[leaseKey(namespace, name, uid)]
	return exp, ok && now.Before(exp)
}
func (f *fakeLeases) WaitAdded() <-chan struct{} { return make(chan struct{}) }
func (f *fakeLeases) Synced() bool               { return true }

func (f *fakeLeases) add(n pki.LeaseName, exp time.Time) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.live[leaseKey(n.Namespace, secretName(n), types.UID(n.UID))] = exp
}

func (f *fakeLeases) remove(n pki.LeaseName) {
	f.mu.Lock()
	defer f.mu.Unlock()
	delete(f.live, leaseKey(n.Namespace, secretName(n), types.UID(n.UID)))
}

type denyList struct {
	mu      sync.Mutex
	revoked map[string]bool
}

func (d *denyList) Revoked(identity string, serials ...string) bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.revoked[identity] {
		return true
	}
	for _, s := range serials {
		if d.revoked[s] {
			return true
		}
	}
	return false
}

type memAudit struct {
	mu     sync.Mutex
	events []audit.Event
}

func (m *memAudit) Audit(ev audit.Event) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.events = append(m.events, ev)
	return nil
}

func (m *memAudit) all() []audit.Event {
	m.mu.Lock()
	defer m.mu.Unlock()
	return append([]audit.Event(nil), m.events...)
}

// closer is a connection's socket as AdmitConn sees it.
type closer struct{ closed chan struct{} }

func newCloser() *closer { return &closer{closed: make(chan struct{})} }
func (c *closer) Close() error {
	select {
	case <-c.closed:
	default:
		close(c.closed)
	}
	return nil
}

func (c *closer) isClosed(t *testing.T) bool {
	t.Helper()
	select {
	case <-c.closed:
		return true
	case <-time.After(2 * time.Second): // Gone closes in the background
		return false
	}
}

type fixture struct {
	ca     *pki.CA
	clock  *clocktesting.FakeClock
	leases *fakeLeases
	deny   *denyList
	audit  *memAudit
	gw     *Gateway
}

var (
	leaseA = pki.LeaseName{Namespace: "argo", ServiceAccount: "runner", ID: "aaaaaaaaaaaaaaaaaaaaaaaaaa", UID: "0f8fad5b-d9cb-469f-a165-70867728950e", Peer: "spiffe://oc.example/cluster/west"}
	leaseB = pki.LeaseName{Namespace: "argo", ServiceAccount: "runner", ID: "bbbbbbbbbbbbbbbbbbbbbbbbbb", UID: "1f8fad5b-d9cb-469f-a165-70867728950e", Peer: "spiffe://oc.example/cluster/west"}
)

func newFixture(t testing.TB, upstream *url.URL, transport http.RoundTripper, cfg func(*Config)) *fixture {
	t.Helper()
	f := &fixture{clock: clocktesting.NewFakeClock(time.Now()), leases: &fakeLeases{live: map[string]time.Time{}},
		deny: &denyList{revoked: map[string]bool{}}, audit: &memAudit{}}
	var err error
	f.ca, err = pki.NewCA(pki.CAOptions{CommonName: "gateway test", Now: f.clock.Now})
	require.NoError(t, err)
	if upstream == nil {
		upstream, _ = url.Parse("https://127.0.0.1:1")
	}
	if transport == nil {
		transport = http.DefaultTransport
	}
	c := Config{Upstream: upstream, Transport: transport, UpgradeTransport: transport,
		Tokens: func(context.Context, pki.LeaseName) (string, error) { return "upstream-token", nil },
		Leases: f.leases, Deny: f.deny, Auditor: f.audit, Logger: zap.NewNop(), Clock: f.clock}
	if cfg != nil {
		cfg(&c)
	}
	f.gw, err = New(c)
	require.NoError(t, err)
	return f
}

// cert signs n's lease certificate, valid for ttl, and returns it with
// its key.
func (f *fixture) cert(t testing.TB, n pki.LeaseName, ttl time.Duration) (*x509.Certificate, tls.Certificate) {
	t.Helper()
	pub, keyPEM, err := f.ca.NewLeaseKey()
	require.NoError(t, err)
	kp, err := f.ca.SignLease(pub, n, f.clock.Now().Add(ttl))
	require.NoError(t, err)
	pair, err := tls.X509KeyPair(kp.CertPEM, keyPEM)
	require.NoError(t, err)
	return kp.Cert, pair
}

func (f *fixture) admit(t *testing.T, n pki.LeaseName, c io.Closer) (func(), string) {
	t.Helper()
	leaf, _ := f.cert(t, n, time.Hour)
	release, reason, _ := f.gw.AdmitConn(tls.ConnectionState{PeerCertificates: []*x509.Certificate{leaf}}, c)
	return release, reason
}

func TestGoneClosesEveryConnectionOfTheLeaseAndNoOther(t *testing.T) {
	f := newFixture(t, nil, nil, nil)
	a1, a2, b := newCloser(), newCloser(), newCloser()
	for _, x := range []struct {
		n pki.LeaseName
		c *closer
	}{{leaseA, a1}, {leaseA, a2}, {leaseB, b}} {
		_, reason := f.admit(t, x.n, x.c)
		require.Empty(t, reason)
	}
	f.gw.Gone(leaseA.Namespace, secretName(leaseA), types.UID(leaseA.UID))
	require.True(t, a1.isClosed(t))
	require.True(t, a2.isClosed(t))
	select {
	case <-b.closed:
		t.Fatal("another lease's connection was closed")
	default:
	}
	// A Secret of the same name under another UID is another lease.
	f.gw.Gone(leaseB.Namespace, secretName(leaseB), "2f8fad5b-d9cb-469f-a165-70867728950e")
	select {
	case <-b.closed:
		t.Fatal("a Secret under another UID ended the lease's connections")
	default:
	}
	// The close is audited in the background, after the sockets close.
	closes := func() []audit.Event {
		var out []audit.Event
		for _, ev := range f.audit.all() {
			if ev.Action == audit.ActionGatewayClose {
				out = append(out, ev)
			}
		}
		return out
	}
	require.Eventually(t, func() bool { return len(closes()) > 0 }, 2*time.Second, time.Millisecond)
	require.Len(t, closes(), 1)
	ev := closes()[0]
	require.Equal(t, leaseA.ID, ev.LeaseID)
	require.Equal(t, 2, ev.Connections)
	require.Equal(t, "revoked", ev.Reason)
}

func TestConnectionsAreCappedPerLeaseAndPerPeer(t *testing.T) {
	f := newFixture(t, nil, nil, func(c *Config) { c.MaxConnsPerLease, c.MaxConnsPerPeer = 2, 3 })
	var releases []func()
	for range 2 {
		release, reason := f.admit(t, leaseA, newCloser())
		require.Empty(t, reason)
		releases = append(releases, release)
	}
	_, reason := f.admit(t, leaseA, newCloser())
	require.Equal(t, RefusedPerLease, reason)
	_, reason = f.admit(t, leaseB, newCloser())
	require.Empty(t, reason)
	_, reason = f.admit(t, leaseB, newCloser())
	require.Equal(t, RefusedPerPeer, reason, "the peer's leases together")
	releases[0]()
	releases[0]() // a second release gives nothing back twice
	_, reason = f.admit(t, leaseA, newCloser())
	require.Empty(t, reason, "a closed connection gives its place back")
	_, reason = f.admit(t, leaseA, newCloser())
	require.Equal(t, RefusedPerLease, reason)
}

func TestALeasesConnectionsEndWithItsCertificate(t *testing.T) {
	f := newFixture(t, nil, nil, nil)
	c := newCloser()
	leaf, _ := f.cert(t, leaseA, 10*time.Minute)
	_, reason, _ := f.gw.AdmitConn(tls.ConnectionState{PeerCertificates: []*x509.Certificate{leaf}}, c)
	require.Empty(t, reason)
	f.clock.Step(9 * time.Minute)
	select {
	case <-c.closed:
		t.Fatal("closed before the certificate expired")
	default:
	}
	f.clock.Step(time.Minute)
	require.True(t, c.isClosed(t), "closed as the certificate expires")
}

func TestTheDenyListEndsAPeersConnections(t *testing.T) {
	f := newFixture(t, nil, nil, nil)
	c := newCloser()
	_, reason := f.admit(t, leaseA, c)
	require.Empty(t, reason)
	f.gw.SweepDenied()
	select {
	case <-c.closed:
		t.Fatal("closed before the peer was denied")
	default:
	}
	f.deny.mu.Lock()
	f.deny.revoked[leaseA.Peer] = true
	f.deny.mu.Unlock()
	f.gw.SweepDenied()
	require.True(t, c.isClosed(t))
}

// upstreamRecorder is an API server stand-in that records what reached it.
type upstreamRecorder struct {
	mu  sync.Mutex
	got []*http.Request
}

func (u *upstreamRecorder) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	u.mu.Lock()
	u.got = append(u.got, r.Clone(context.Background()))
	u.mu.Unlock()
	if r.Header.Get("Upgrade") != "" {
		// An upgrade-capable server: 101, then echo every line.
		conn, brw, err := http.NewResponseController(w).Hijack()
		if err != nil {
			return
		}
		defer conn.Close()
		fmt.Fprintf(brw, "HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: %s\r\n\r\n", r.Header.Get("Upgrade"))
		_ = brw.Flush()
		for {
			line, err := brw.ReadString('\n')
			if err != nil {
				return
			}
			_, _ = brw.WriteString("echo " + line)
			_ = brw.Flush()
		}
	}
	w.Header().Set("Content-Type", "application/json")
	_, _ = io.WriteString(w, `{"kind":"Status"}`)
}

// serveGateway serves f's gateway over TLS on 127.0.0.1 with the lease
// gateway's TLS profile (pki.GatewayTLSConfig, against f's CA at f's
// clock), each connection admitted as the broker's listener admits it.
func serveGateway(t *testing.T, f *fixture) *httptest.Server {
	t.Helper()
	srv := httptest.NewUnstartedServer(f.gw)
	serving, err := f.ca.IssueServer(pki.ServerOptions{IPAddresses: []net.IP{net.IPv4(127, 0, 0, 1)}})
	require.NoError(t, err)
	dir := t.TempDir()
	certFile, keyFile := filepath.Join(dir, "tls.crt"), filepath.Join(dir, "tls.key")
	require.NoError(t, os.WriteFile(certFile, serving.CertPEM, 0o600))
	require.NoError(t, os.WriteFile(keyFile, serving.KeyPEM, 0o600))
	certs, err := pki.NewCertReloader(certFile, keyFile)
	require.NoError(t, err)
	srv.TLS = pki.GatewayTLSConfig(certs, f.ca.CertPool, f.clock.Now)
	srv.Config.ConnContext = func(ctx context.Context, c net.Conn) context.Context {
		tc := c.(*tls.Conn)
		if tc.HandshakeContext(ctx) == nil {
			if _, reason, _ := f.gw.AdmitConn(tc.ConnectionState(), tc.NetConn()); reason != "" {
				_ = tc.NetConn().Close()
			}
		}
		return ctx
	}
	srv.StartTLS()
	t.Cleanup(srv.Close)
	return srv
}

func TestAForwardedRequestCarriesTheGatewaysCredentialOnly(t *testing.T) {
	rec, f, gw := recordingGateway(t)
	_, pair := f.cert(t, leaseA, time.Hour)
	client := &http.Client{Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: f.ca.CertPool(), Certificates: []tls.Certificate{pair}}}}

	req, err := http.NewRequest(http.MethodGet, gw.URL+"/api/v1/namespaces/argo/configmaps?limit=1", nil)
	require.NoError(t, err)
	req.Header.Set("Authorization", "Bearer stolen")
	req.Header.Set("Audit-Id", "chosen-by-the-client")
	req.Header.Set("X-Remote-User", "system:admin")
	req.Header.Set("X-Remote-Extra-Scopes", "all")
	req.Header.Set("X-Remote-Uid", "0")
	req.Header.Set("User-Agent", "kubectl/v1.37")
	resp, err := client.Do(req)
	require.NoError(t, err)
	_, _ = io.Copy(io.Discard, resp.Body) // the connection goes back to the pool
	resp.Body.Close()
	require.Equal(t, http.StatusOK, resp.StatusCode)

	rec.mu.Lock()
	got := rec.got[0]
	rec.mu.Unlock()
	require.Equal(t, "Bearer upstream-token", got.Header.Get("Authorization"))
	require.Empty(t, got.Header.Get("X-Remote-User"))
	require.Empty(t, got.Header.Get("X-Remote-Extra-Scopes"))
	require.Empty(t, got.Header.Get("X-Remote-Uid"))
	require.Empty(t, got.Header.Get("X-Forwarded-For"))
	require.Equal(t, "/api/v1/namespaces/argo/configmaps", got.URL.Path)
	require.Equal(t, "limit=1", got.URL.RawQuery)
	require.Equal(t, "kubectl/v1.37"+UserAgentSuffix+leaseA.ID, got.Header.Get("User-Agent"))
	auditID := got.Header.Get("Audit-Id")
	require.NotEqual(t, "chosen-by-the-client", auditID)
	require.Regexp(t, `^[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$`, auditID, "a version 4 UUID, as the API server's own")
	var ev audit.Event
	// The event is written as the handler returns, after the answer.
	require.Eventually(t, func() bool {
		for _, e := range f.audit.all() {
			if e.Action == audit.ActionGatewayRequest {
				ev = e
				return true
			}
		}
		return false
	}, 5*time.Second, time.Millisecond)
	require.Equal(t, auditID, ev.APIAuditID, "the broker's audit and the API server's name the request alike")
	require.Equal(t, leaseA.ID, ev.LeaseID)
	require.Equal(t, http.StatusOK, ev.Status)
	require.Equal(t, "/api/v1/namespaces/argo/configmaps", ev.Path)

	// Once the lease is gone, the same certificate is refused on its open
	// connection as the API server refuses a bad credential, and the
	// connection closed.
	f.leases.remove(leaseA)
	f.clock.Step(time.Minute) // past the wait for a lease signed moments ago
	resp, err = client.Get(gw.URL + "/api")
	require.NoError(t, err)
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	require.Equal(t, http.StatusUnauthorized, resp.StatusCode)
	require.Contains(t, string(body), `"kind":"Status"`)
	require.Contains(t, string(body), "revoked or expired")
	require.True(t, resp.Close, "the refused request's connection closes")
	// A new connection holds no place, but is answered why.
	resp, err = client.Get(gw.URL + "/api")
	require.NoError(t, err)
	resp.Body.Close()
	require.Equal(t, http.StatusUnauthorized, resp.StatusCode)
}

func TestABodyOverTheAPIServersLimitIsRefused(t *testing.T) {
	rec := &upstreamRecorder{}
	up := httptest.NewTLSServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if _, err := io.Copy(io.Discard, r.Body); err != nil {
			return
		}
		rec.ServeHTTP(w, r)
	}))
	t.Cleanup(up.Close)
	u, _ := url.Parse(up.URL)
	f := newFixture(t, u, up.Client().Transport, func(c *Config) { c.MaxBodyBytes = 1 << 10 })
	f.leases.add(leaseA, f.clock.Now().Add(time.Hour))
	gw := serveGateway(t, f)
	_, pair := f.cert(t, leaseA, time.Hour)
	client := &http.Client{Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: f.ca.CertPool(), Certificates: []tls.Certificate{pair}}}}
	resp, err := client.Post(gw.URL+"/api/v1/namespaces/argo/configmaps", "application/json", strings.NewReader(strings.Repeat("x", 2<<10)))
	require.NoError(t, err)
	resp.Body.Close()
	require.Equal(t, http.StatusRequestEntityTooLarge, resp.StatusCode)
}

// An upgraded stream (exec, attach, port-forward speak SPDY or WebSocket
// this way) passes through, and ends when its lease goes.
func TestAnUpgradedStreamPassesAndEndsWithItsLease(t *testing.T) {
	rec := &upstreamRecorder{}
	up := httptest.NewTLSServer(rec)
	t.Cleanup(up.Close)
	u, _ := url.Parse(up.URL)
	upTLS := up.Client().Transport.(*http.Transport).TLSClientConfig.Clone()
	upTLS.NextProtos = []string{"http/1.1"}
	f := newFixture(t, u, up.Client().Transport, func(c *Config) { c.UpgradeTransport = &http.Transport{TLSClientConfig: upTLS} })
	f.leases.add(leaseA, f.clock.Now().Add(time.Hour))
	gw := serveGateway(t, f)

	conn := rawHTTP1(t, f, gw, leaseA)
	fmt.Fprintf(conn, "POST /api/v1/namespaces/argo/pods/p/exec?command=sh HTTP/1.1\r\nHost: gw\r\nConnection: Upgrade\r\nUpgrade: SPDY/3.1\r\nX-Stream-Protocol-Version: v4.channel.k8s.io\r\n\r\n")
	br := bufio.NewReader(conn)
	resp, err := http.ReadResponse(br, nil)
	require.NoError(t, err)
	require.Equal(t, http.StatusSwitchingProtocols, resp.StatusCode)
	fmt.Fprintf(conn, "hello\n")
	line, err := br.ReadString('\n')
	require.NoError(t, err)
	require.Equal(t, "echo hello\n", line)
	// On the record from its start: forwarded, then upgraded.
	var actions []string
	for _, e := range f.audit.all() {
		actions = append(actions, e.Action)
	}
	require.Equal(t, []string{audit.ActionGatewayForward, audit.ActionGatewayUpgrade}, actions)

	f.gw.Gone(leaseA.Namespace, secretName(leaseA), types.UID(leaseA.UID))
	require.NoError(t, conn.SetReadDeadline(time.Now().Add(5*time.Second)))
	_, err = br.ReadString('\n')
	require.Error(t, err, "the stream ends when its lease goes")
	var ne net.Error
	require.False(t, errorsAs(err, &ne) && ne.Timeout(), "ended, not timed out: %v", err)
}

func errorsAs(err error, target *net.Error) bool {
	ne, ok := err.(net.Error)
	if ok {
		*target = ne
	}
	return ok
}

// A lease revoked moments after its issuance is refused at once: the
// gateway waits for a young lease it has not seen only if the counter did
// not report it gone.
func TestAYoungRevokedLeaseIsRefusedAtOnce(t *testing.T) {
	rec := &upstreamRecorder{}
	up := httptest.NewTLSServer(rec)
	t.Cleanup(up.Close)
	u, _ := url.Parse(up.URL)
	f := newFixture(t, u, up.Client().Transport, nil)
	gw := serveGateway(t, f)
	_, pair := f.cert(t, leaseA, time.Hour) // signed now: young
	f.gw.Gone(leaseA.Namespace, secretName(leaseA), types.UID(leaseA.UID))
	// The fake clock never fires the wait: without the record of the
	// revocation this request would hang until the client's timeout.
	client := &http.Client{Timeout: 5 * time.Second, Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: f.ca.CertPool(), Certificates: []tls.Certificate{pair}}}}
	resp, err := client.Get(gw.URL + "/api")
	require.NoError(t, err)
	resp.Body.Close()
	require.Equal(t, http.StatusUnauthorized, resp.StatusCode)
	require.Zero(t, f.gw.OpenConns(leaseA.Namespace, secretName(leaseA), types.UID(leaseA.UID)), "no connection place")
}

func TestAuditIDsAreRandomVersion4UUIDs(t *testing.T) {
	t.Parallel()
	seen := map[string]bool{}
	for range 1000 {
		id := newAuditID()
		require.Regexp(t, `^[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$`, id)
		require.False(t, seen[id], "an audit id came twice")
		seen[id] = true
	}
}

// Whether a buffer put back is the one got next is sync.Pool's to decide
// (BenchmarkForward's allocations show that it is); what the gateway
// relies on is that a buffer got is always whole.
func TestCopyBuffersComeWholeWhateverIsPutBack(t *testing.T) {
	t.Parallel()
	buf := CopyBuffers().Get()
	require.Len(t, buf, 32<<10, "httputil.ReverseProxy's own buffer size")
	CopyBuffers().Put(buf[:10]) // as a copy may leave it: still the pool's
	require.NotPanics(t, func() {
		CopyBuffers().Put(make([]byte, 100))   // not the pool's: dropped
		CopyBuffers().Put(make([]byte, 0, 64)) // nor this
	})
	got := CopyBuffers().Get()
	require.Len(t, got, 32<<10, "whatever was put, a buffer comes back whole")
}

// The requests of an admitted connection reuse what AdmitConn read from
// its certificate (connLease), and are still checked against the deny
// list as it is now; what was kept goes with the connection's last close.
func TestAnAdmittedConnectionsRequestsReuseItsLeaseAndMeetTheDenyListAsItIsNow(t *testing.T) {
	t.Parallel()
	upstream := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		_, _ = io.WriteString(w, `{"kind":"ConfigMap"}`)
	}))
	t.Cleanup(upstream.Close)
	u, err := url.Parse(upstream.URL)
	require.NoError(t, err)
	f := newFixture(t, u, upstream.Client().Transport, nil)
	f.leases.add(leaseA, f.clock.Now().Add(time.Hour))
	leaf, _ := f.cert(t, leaseA, time.Hour)
	st := tls.ConnectionState{HandshakeComplete: true, Version: tls.VersionTLS13,
		PeerCertificates: []*x509.Certificate{leaf}, VerifiedChains: [][]*x509.Certificate{{leaf, f.ca.Certificate()}}}
	get := func() int {
		r := httptest.NewRequest(http.MethodGet, "https://gateway.example/api/v1/namespaces/argo/configmaps/c", nil)
		r.TLS = &st
		w := httptest.NewRecorder()
		f.gw.ServeHTTP(w, r)
		return w.Code
	}
	kept := func() *connLease {
		f.gw.mu.Lock()
		defer f.gw.mu.Unlock()
		return f.gw.admitted[leaf]
	}

	first, reason, _ := f.gw.AdmitConn(st, newCloser())
	require.Empty(t, reason)
	second, reason, _ := f.gw.AdmitConn(st, newCloser()) // the same leaf on another connection
	require.Empty(t, reason)
	cl := kept()
	require.NotNil(t, cl)
	require.Equal(t, leaseA.ID, cl.name.ID)
	require.Equal(t, []string{serialOf(leaf), serialOf(f.ca.Certificate())}, cl.serials)
	require.Equal(t, http.StatusOK, get())

	// Revoked after the connection was admitted, and before any sweep:
	// its next request is refused.
	f.deny.mu.Lock()
	f.deny.revoked[serialOf(f.ca.Certificate())] = true
	f.deny.mu.Unlock()
	require.Equal(t, http.StatusForbidden, get())

	first()
	require.Same(t, cl, kept(), "kept while a connection with the leaf is open")
	second()
	require.Nil(t, kept(), "gone with the last")
	f.gw.mu.Lock()
	require.Empty(t, f.gw.admitted)
	f.gw.mu.Unlock()
	require.Equal(t, http.StatusForbidden, get(), "read again from the certificate, and refused the same")
}

// Over the gateway's own TLS profile, the connection's verified chain
// reaches the deny list: revoking the CA that signed a lease refuses the
// next request of a connection already open, as revoking the lease's
// serial does.
func TestRevokingTheSigningCARefusesAnOpenConnectionsNextRequest(t *testing.T) {
	_, f, gw := recordingGateway(t)
	f.leases.add(leaseA, f.clock.Now().Add(time.Hour))
	client := f.client(t, leaseA)
	get := func() int {
		resp, err := client.Get(gw.URL + "/api/v1/namespaces/argo/configmaps")
		require.NoError(t, err)
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		return resp.StatusCode
	}
	require.Equal(t, http.StatusOK, get())

	f.deny.mu.Lock()
	f.deny.revoked[serialOf(f.ca.Certificate())] = true
	f.deny.mu.Unlock()
	require.Equal(t, http.StatusForbidden, get())
}
