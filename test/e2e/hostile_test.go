package e2e

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
	"github.com/tokenbroker/tokenbroker/broker/objects"
	"github.com/tokenbroker/tokenbroker/pki"
	"github.com/tokenbroker/tokenbroker/test/testcluster"
)

// hostileRequest is one bad request and the status the docs promise.
type hostileRequest struct {
	name        string
	method      string
	path        string
	contentType string // "" sends none
	accept      string
	body        string
	status      int
}

func hostileRequests() []hostileRequest {
	post := func(name, body string, status int) hostileRequest {
		return hostileRequest{name: name, method: http.MethodPost, path: "/v1/kubeconfigs", contentType: apiv1.MediaTypeJSON, body: body, status: status}
	}
	req := func(fields string) string {
		return `{"namespace":"argo","serviceAccount":"runner"` + fields + `}`
	}
	long := strings.Repeat("a", 300)
	var aud []string
	for i := range 17 {
		aud = append(aud, fmt.Sprintf("%q", fmt.Sprint("aud", i)))
	}
	nested := strings.Repeat("[", 10000) + strings.Repeat("]", 10000)
	return []hostileRequest{
		post("an empty body", ``, 400),
		post("a truncated object", `{"namespace":"argo",`, 400),
		post("an array instead of an object", `[]`, 400),
		post("null", `null`, 400),
		post("a string instead of an object", `"argo"`, 400),
		post("an unknown field", req(`,"foo":1`), 400),
		post("a field in another case", `{"Namespace":"argo","serviceAccount":"runner"}`, 400),
		post("a duplicate key that would change the namespace", `{"namespace":"argo","namespace":"kube-system","serviceAccount":"runner"}`, 400),
		post("a duplicate key spelt with an escape", `{"namespace":"argo","n\u0061mespace":"kube-system","serviceAccount":"runner"}`, 400),
		post("a second object after the first", req(``)+req(``), 400),
		post("garbage after the object", req(``)+`x`, 400),
		post("a number for the namespace", `{"namespace":1,"serviceAccount":"runner"}`, 400),
		post("a number for the TTL", req(`,"ttl":0`), 400),
		post("a negative TTL", req(`,"ttl":"-1h"`), 400),
		post("an overflowing TTL", req(`,"ttl":"1e9h"`), 400),
		post("a TTL in days", req(`,"ttl":"1d"`), 400),
		post("a zero TTL", req(`,"ttl":"0s"`), 400),
		post("a TTL past the Go duration range", req(`,"ttl":"9999999999999h"`), 400),
		post("a TTL with a space", req(`,"ttl":" 1h"`), 400),
		post("a TTL string far too long", req(`,"ttl":"`+strings.Repeat("1", 100)+`s"`), 400),
		post("a minTTL that is not a duration", req(`,"minTTL":"abc"`), 400),
		post("a minTTL above the TTL", req(`,"ttl":"1h","minTTL":"2h"`), 400),
		post("an upper-case namespace", `{"namespace":"Argo","serviceAccount":"runner"}`, 400),
		post("a path traversal in the namespace", `{"namespace":"../kube-system","serviceAccount":"runner"}`, 400),
		post("a namespace over 63 characters", `{"namespace":"`+strings.Repeat("a", 64)+`","serviceAccount":"runner"}`, 400),
		post("a namespace with a Cyrillic look-alike letter", `{"namespace":"\u0430rgo","serviceAccount":"runner"}`, 400),
		post("a namespace with a right-to-left override", `{"namespace":"\u202eogra","serviceAccount":"runner"}`, 400),
		post("a ServiceAccount with a NUL byte", `{"namespace":"argo","serviceAccount":"run\u0000ner"}`, 400),
		post("an empty ServiceAccount", `{"namespace":"argo","serviceAccount":""}`, 400),
		post("a missing ServiceAccount", `{"namespace":"argo"}`, 400),
		post("a ServiceAccount over 253 characters", `{"namespace":"argo","serviceAccount":"`+strings.Repeat("a", 254)+`"}`, 400),
		post("invalid UTF-8", "{\"namespace\":\"ar\xffgo\",\"serviceAccount\":\"runner\"}", 400),
		post("seventeen audiences", req(`,"audiences":[`+strings.Join(aud, ",")+`]`), 400),
		post("an empty audience", req(`,"audiences":[""]`), 400),
		post("an audience of 300 characters", req(`,"audiences":["`+long+`"]`), 400),
		post("an unknown credential kind", req(`,"credential":"password"`), 400),
		post("deeply nested arrays", `{"namespace":`+nested+`,"serviceAccount":"runner"}`, 400),
		post("a body of 1 MiB", `{"namespace":"`+strings.Repeat("a", 1<<20)+`"}`, 413),
		post("a body just over the 64 KiB limit", `{"namespace":"argo","serviceAccount":"runner","audiences":["`+strings.Repeat("a", 64<<10)+`"]}`, 413),
		post("a namespace outside the grant", `{"namespace":"kube-system","serviceAccount":"runner"}`, 403),
		// The grant lists no audiences: any audience named is refused,
		// however it is dressed up (issue #27).
		post("an audience for AWS STS the grant does not list", req(`,"audiences":["sts.amazonaws.com"]`), 403),
		post("the API server's own audience named explicitly", req(`,"audiences":["https://kubernetes.default.svc.cluster.local"]`), 403),
		post("a look-alike audience with a Cyrillic letter", req(`,"audiences":["st\u0455.amazonaws.com"]`), 403),
		post("an audience with a NUL byte", req(`,"audiences":["sts.amazonaws.com\u0000"]`), 403),
		post("a wildcard audience", req(`,"audiences":["*"]`), 403),
		post("sixteen audiences, none listed", req(`,"audiences":[`+strings.Join(aud[:16], ",")+`]`), 403),
		post("a ServiceAccount outside the grant", `{"namespace":"argo","serviceAccount":"admin"}`, 403),
		post("a credential kind the grant does not give", `{"namespace":"argo","credential":"clientCertificate","ttl":"1h"}`, 403),
		post("a client certificate for a ServiceAccount", req(`,"credential":"clientCertificate"`), 400),
		{name: "a text/plain body", method: http.MethodPost, path: "/v1/kubeconfigs", contentType: "text/plain", body: req(``), status: 415},
		{name: "no Content-Type", method: http.MethodPost, path: "/v1/kubeconfigs", body: req(``), status: 415},
		{name: "a JSON body in Latin-1", method: http.MethodPost, path: "/v1/kubeconfigs", contentType: "application/json; charset=iso-8859-1", body: req(``), status: 415},
		{name: "an Accept the broker cannot produce", method: http.MethodPost, path: "/v1/kubeconfigs", contentType: apiv1.MediaTypeJSON, accept: "text/html", body: req(``), status: 406},
		{name: "a lease id with a path traversal", method: http.MethodGet, path: "/v1/leases/..%2F..%2Fetc%2Fpasswd", status: 404},
		{name: "a lease id with a NUL byte", method: http.MethodGet, path: "/v1/leases/%00", status: 404},
		{name: "a lease id one character too long", method: http.MethodGet, path: "/v1/leases/" + strings.Repeat("a", 27), status: 404},
		{name: "an upper-case lease id", method: http.MethodDelete, path: "/v1/leases/" + strings.Repeat("A", 26), status: 404},
		{name: "a well-formed lease id that does not exist", method: http.MethodDelete, path: "/v1/leases/" + strings.Repeat("a", 26), status: 404},
		{name: "a method the route does not have", method: http.MethodPut, path: "/v1/kubeconfigs", contentType: apiv1.MediaTypeJSON, body: req(``), status: 405},
		{name: "an unknown path", method: http.MethodGet, path: "/v1/secrets", status: 404},
		{name: "an unknown version", method: http.MethodGet, path: "/v2/whoami", status: 404},
	}
}

// TestHostileInput sends every request of the table to a broker process
// and checks the documented 4xx problem+json answer, that nothing got a
// 5xx and that no lease was created.
func TestHostileInput(t *testing.T) {
	c := testcluster.Start(t)
	setUpTarget(t, c)
	e := startBroker(t, c)
	client := e.goClient(t, "west")
	leasesBefore := countLeases(t, c)

	cases := hostileRequests()
	require.GreaterOrEqual(t, len(cases), 40)
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			req, err := http.NewRequest(tc.method, "https://"+e.api+tc.path, strings.NewReader(tc.body))
			require.NoError(t, err)
			if tc.contentType != "" {
				req.Header.Set("Content-Type", tc.contentType)
			}
			if tc.accept != "" {
				req.Header.Set("Accept", tc.accept)
			}
			resp, err := client.Do(req)
			require.NoError(t, err)
			defer resp.Body.Close()
			body, err := io.ReadAll(resp.Body)
			require.NoError(t, err)
			require.Equal(t, tc.status, resp.StatusCode, string(body))
			require.Equal(t, apiv1.MediaTypeProblem, resp.Header.Get("Content-Type"))
			var p apiv1.Problem
			require.NoError(t, json.Unmarshal(body, &p), string(body))
			require.Equal(t, tc.status, p.Status)
			require.True(t, strings.HasPrefix(p.Type, "urn:tokenbroker:problem:"), p.Type)
			require.NotEmpty(t, p.Title)
		})
	}

	t.Run("headers over the limit are refused by the HTTP server with 431", func(t *testing.T) {
		req, err := http.NewRequest(http.MethodGet, "https://"+e.api+"/v1/whoami", nil)
		require.NoError(t, err)
		req.Header.Set("X-Padding", strings.Repeat("a", 64<<10))
		resp, err := client.Do(req)
		require.NoError(t, err)
		resp.Body.Close()
		// net/http answers this before any handler runs (see docs/api.md).
		require.Equal(t, http.StatusRequestHeaderFieldsTooLarge, resp.StatusCode)
	})

	t.Run("many concurrent connections are served without a 5xx", func(t *testing.T) {
		var wg sync.WaitGroup
		var mu sync.Mutex
		statuses := map[int]int{}
		for range 200 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				// A fresh connection each: 200 handshakes at once.
				cl := e.goClient(t, "west")
				defer cl.CloseIdleConnections()
				resp, err := cl.Get("https://" + e.api + "/v1/whoami")
				mu.Lock()
				defer mu.Unlock()
				if err != nil {
					statuses[-1]++
					return
				}
				resp.Body.Close()
				statuses[resp.StatusCode]++
			}()
		}
		wg.Wait()
		require.Equal(t, map[int]int{200: 200}, statuses)
	})

	t.Run("a slow-header client is cut off and the broker keeps serving", func(t *testing.T) {
		conn, err := tls.Dial("tcp", e.api, e.tlsConfig(t, "west"))
		require.NoError(t, err)
		defer conn.Close()
		_, err = conn.Write([]byte("GET /v1/whoami HTTP/1.1\r\nHost: x\r\n"))
		require.NoError(t, err)
		start := time.Now()
		// Never finish the headers; the server's ReadHeaderTimeout ends it.
		_ = conn.SetReadDeadline(time.Now().Add(30 * time.Second))
		_, err = io.ReadAll(conn)
		require.Less(t, time.Since(start), 15*time.Second, "the connection must be closed by the server: %v", err)
		resp, err := client.Get("https://" + e.api + "/v1/whoami")
		require.NoError(t, err)
		resp.Body.Close()
		require.Equal(t, 200, resp.StatusCode)
	})

	t.Run("no request created a lease and no 5xx was logged", func(t *testing.T) {
		require.Equal(t, leasesBefore, countLeases(t, c))
		require.NotRegexp(t, `"status":5\d\d`, e.proc.logs.String())
	})
}

// TestTLSRefusals checks that the mTLS listener refuses every bad client in
// the handshake, with Go's TLS client and with openssl s_client.
func TestTLSRefusals(t *testing.T) {
	c := testcluster.Start(t)
	setUpTarget(t, c)
	e := startBroker(t, c)
	pkiDir := filepath.Join(e.dir, "pki")
	at := func(d time.Duration) *pki.CA {
		ca, err := pki.LoadCAWithOptions(filepath.Join(pkiDir, "ca.crt"), filepath.Join(pkiDir, "ca.key"),
			pki.CAOptions{Now: func() time.Time { return time.Now().Add(d) }})
		require.NoError(t, err)
		return ca
	}
	id, err := pki.ClusterIdentity("e2e.example", "west")
	require.NoError(t, err)
	write := func(name string, kp *pki.KeyPair) string {
		prefix := filepath.Join(e.dir, name)
		require.NoError(t, kp.WriteFiles(prefix+".crt", prefix+".key"))
		return prefix
	}
	expired, err := at(-48 * time.Hour).IssueClient(pki.ClientOptions{Identity: id, Lifetime: time.Hour})
	require.NoError(t, err)
	future, err := at(48 * time.Hour).IssueClient(pki.ClientOptions{Identity: id, Lifetime: time.Hour})
	require.NoError(t, err)
	serverOnly, err := at(0).IssueServer(pki.ServerOptions{DNSNames: []string{"west.example"}})
	require.NoError(t, err)

	clients := []struct {
		name   string
		prefix string // "" for no certificate
		tls12  bool
		reason string // what the broker logs (tokenbroker_tls_handshake_failures_total's reason)
	}{
		{name: "a TLS 1.2 client", prefix: filepath.Join(e.dir, "west"), tls12: true, reason: "protocol_version"},
		{name: "a client without a certificate", reason: "no_certificate"},
		{name: "an expired certificate", prefix: write("expired", expired), reason: "expired"},
		{name: "a certificate that is not valid yet", prefix: write("future", future), reason: "expired"},
		{name: "a certificate from another CA", prefix: filepath.Join(e.dir, "impostor"), reason: "unknown_authority"},
		{name: "a server certificate used as a client certificate", prefix: write("serveronly", serverOnly), reason: "wrong_usage"},
	}
	for _, cl := range clients {
		t.Run(cl.name+" is refused by the Go TLS client's handshake", func(t *testing.T) {
			before := e.handshakeFailures(t, cl.reason)
			cfg := &tls.Config{RootCAs: mustPool(t, e.ca), MinVersion: tls.VersionTLS12}
			if cl.tls12 {
				cfg.MaxVersion = tls.VersionTLS12
			}
			if cl.prefix != "" {
				cert, err := tls.LoadX509KeyPair(cl.prefix+".crt", cl.prefix+".key")
				require.NoError(t, err)
				cfg.Certificates = []tls.Certificate{cert}
			}
			conn, err := tls.Dial("tcp", e.api, cfg)
			if err == nil {
				// TLS 1.3: the server's verdict on the client certificate
				// arrives after the client's side of the handshake.
				_ = conn.SetDeadline(time.Now().Add(5 * time.Second))
				_, _ = conn.Write([]byte("GET /v1/whoami HTTP/1.1\r\nHost: x\r\n\r\n"))
				_, err = conn.Read(make([]byte, 1))
				conn.Close()
			}
			require.Error(t, err, "the broker must refuse the connection")
			e.requireHandshakeFailure(t, cl.reason, before)
		})
		t.Run(cl.name+" is refused with openssl s_client", func(t *testing.T) {
			before := e.handshakeFailures(t, cl.reason)
			args := []string{"s_client", "-connect", e.api, "-CAfile", e.ca, "-verify_return_error", "-ign_eof"}
			if cl.tls12 {
				args = append(args, "-tls1_2")
			}
			if cl.prefix != "" {
				args = append(args, "-cert", cl.prefix+".crt", "-key", cl.prefix+".key")
			}
			cmd := exec.Command("openssl", args...)
			cmd.Stdin = strings.NewReader("GET /v1/whoami HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
			out, _ := cmd.CombinedOutput()
			require.NotContains(t, string(out), "HTTP/1.1 200", "openssl got an answer through a refused connection")
			require.Regexp(t, `(?i)ssl3? alert|alert number|tlsv1[23]? alert`, string(out), "openssl must report the broker's alert")
			e.requireHandshakeFailure(t, cl.reason, before)
		})
	}

	t.Run("a good client certificate passes with openssl s_client", func(t *testing.T) {
		west := filepath.Join(e.dir, "west")
		cmd := exec.Command("openssl", "s_client", "-connect", e.api, "-CAfile", e.ca, "-verify_return_error",
			"-cert", west+".crt", "-key", west+".key", "-quiet")
		cmd.Stdin = strings.NewReader("GET /v1/whoami HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
		out, err := cmd.CombinedOutput()
		require.NoError(t, err, string(out))
		require.Contains(t, string(out), "HTTP/1.1 200")
		require.Contains(t, string(out), "spiffe://e2e.example/cluster/west")
	})
}

// tlsConfig is the production TLS client profile for a client whose
// certificate files are e.dir/<name>.crt and .key.
func (e *brokerEnv) tlsConfig(t *testing.T, name string) *tls.Config {
	t.Helper()
	r, err := pki.NewCertReloader(filepath.Join(e.dir, name+".crt"), filepath.Join(e.dir, name+".key"))
	require.NoError(t, err)
	return pki.ClientTLSConfig(mustPool(t, e.ca), r)
}

// goClient is an HTTP client with the production TLS client profile.
func (e *brokerEnv) goClient(t *testing.T, name string) *http.Client {
	t.Helper()
	return &http.Client{Timeout: 30 * time.Second, Transport: &http.Transport{TLSClientConfig: e.tlsConfig(t, name)}}
}

func mustPool(t *testing.T, file string) *x509.CertPool {
	t.Helper()
	p, err := pki.LoadCertPool(file)
	require.NoError(t, err)
	return p
}

// countLeases counts the broker's Secrets but the unclaimed pooled ones,
// which are no lease (broker/pool.go).
// leaseSecretIDs returns the lease ids of the lease Secrets in c.
func leaseSecretIDs(t *testing.T, c *testcluster.Cluster) map[string]bool {
	t.Helper()
	l, err := c.Client.CoreV1().Secrets("").List(context.Background(), metav1.ListOptions{
		LabelSelector: objects.LabelManagedBy + "=" + objects.ManagedByValue + "," + objects.LabelKind + "=" + objects.LeaseKind,
	})
	require.NoError(t, err)
	ids := map[string]bool{}
	for _, s := range l.Items {
		ids[s.Labels[objects.LabelLeaseID]] = true
	}
	return ids
}

// newLeases counts the leases of c whose ids are not in before: unlike a
// difference of counts, a lease revoked meanwhile (an agent's health
// check) does not hide a new one.
func newLeases(t *testing.T, c *testcluster.Cluster, before map[string]bool) int {
	t.Helper()
	n := 0
	for id := range leaseSecretIDs(t, c) {
		if !before[id] {
			n++
		}
	}
	return n
}

func countLeases(t *testing.T, c *testcluster.Cluster) int {
	t.Helper()
	l, err := c.Client.CoreV1().Secrets("").List(context.Background(), metav1.ListOptions{
		LabelSelector: objects.LabelManagedBy + "=" + objects.ManagedByValue + "," + objects.LabelKind + "!=" + objects.PoolKind,
	})
	require.NoError(t, err)
	return len(l.Items)
}
