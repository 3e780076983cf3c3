package e2e

import (
	"bufio"
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	rbacv1 "k8s.io/api/rbac/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/tools/clientcmd"

	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
	"github.com/tokenbroker/tokenbroker/broker/auditjoin"
	"github.com/tokenbroker/tokenbroker/pki"
	"github.com/tokenbroker/tokenbroker/test/testcluster"
)

// auditJoinPolicy is the minimal audit policy of docs/operations.md ("Who
// used a credential"): metadata of every request, one event per request.
const auditJoinPolicy = `apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: [RequestReceived]
rules:
  - level: None
    users: ["system:kube-controller-manager"]
  - level: Metadata
`

// TestAuditJoin runs "tokenbroker audit" on a real API server's audit log
// and a real broker's audit events: a token lease and a client-certificate
// lease are used, revoked and used again, and every request made with them
// is attributed to its lease, peer and issuing request; the 403s of the
// revoked certificate join, the 401s of the revoked token cannot (they
// carry no credential id), and the summary lists what each lease used and
// what its ServiceAccount may do and never did. Live leases also join from
// their Secrets alone.
func TestAuditJoin(t *testing.T) {
	ctx := context.Background()
	c := testcluster.Start(t, testcluster.WithControllerManager("csrsigning", "garbagecollector"), testcluster.WithAuditPolicy(auditJoinPolicy))
	kubectl := kubectlBinary(t)
	setUpTarget(t, c)
	_, err := c.Client.RbacV1().ClusterRoles().Create(ctx, &rbacv1.ClusterRole{
		ObjectMeta: metav1.ObjectMeta{Name: "audit-e2e-reader"},
		Rules:      []rbacv1.PolicyRule{{APIGroups: []string{""}, Resources: []string{"configmaps"}, Verbs: []string{"get", "list"}}},
	}, metav1.CreateOptions{})
	require.NoError(t, err)
	e := newBrokerEnv(t, c, "--credentials", "token,clientCertificate")
	writeFile(t, e.policy, fmt.Sprintf(`cluster:
  name: east
  server: %s
  caFile: cluster-ca.crt
ttl: {default: 1h, max: 24h}
peers:
  - name: west
    identity: spiffe://e2e.example/cluster/west
    grants:
      - namespaces: [argo]
        serviceAccounts: [runner]
      - namespaces: [argo]
        credential: clientCertificate
        clusterRole: audit-e2e-reader
`, c.URL))
	e.launch(t)
	west := filepath.Join(e.dir, "west")
	issue := func(body, requestID string) (apiv1.KubeconfigResponse, string) {
		t.Helper()
		status, out := e.postKubeconfig(t, west, body, "-H", "X-Request-Id: "+requestID)
		require.Equal(t, 201, status, out)
		var resp apiv1.KubeconfigResponse
		require.NoError(t, json.Unmarshal([]byte(out), &resp))
		return resp, writeFile(t, filepath.Join(t.TempDir(), "kubeconfig"), resp.Kubeconfig)
	}
	as := func(kc string, args ...string) (string, error) {
		_, stderr, err := runErr(kubectl, append([]string{"--kubeconfig", kc, "-n", "argo"}, args...)...)
		return stderr, err
	}
	revoke := func(id string) time.Time {
		t.Helper()
		at := time.Now()
		status, body, err := e.curl(t, west, "-X", "DELETE", "https://"+e.api+"/v1/leases/"+id)
		require.NoError(t, err)
		require.Equal(t, 204, status, body)
		return at
	}

	tok, tokKC := issue(`{"namespace":"argo","serviceAccount":"runner","ttl":"1h"}`, "audit-join-token")
	cert, certKC := issue(`{"namespace":"argo","credential":"clientCertificate","ttl":"1h"}`, "audit-join-cert")

	// Used: list configmaps (allowed) and list secrets (forbidden) with
	// the token; get a configmap and create one (forbidden) with the
	// certificate.
	_, err = as(tokKC, "get", "configmaps")
	require.NoError(t, err)
	stderr, err := as(tokKC, "get", "secrets")
	require.Error(t, err)
	require.Contains(t, stderr, "forbidden")
	_, err = as(certKC, "get", "configmap", "hello")
	require.NoError(t, err)
	stderr, err = as(certKC, "create", "configmap", "x")
	require.Error(t, err)
	require.Contains(t, stderr, "forbidden")

	// Revoked: the certificate still authenticates and is refused by
	// RBAC once its RoleBinding is gone; the token stops authenticating
	// (within the API server's ~10 s cache of authentications).
	certRevoked := revoke(cert.LeaseID)
	require.Eventually(t, func() bool {
		stderr, err := as(certKC, "get", "configmap", "hello")
		return err != nil && strings.Contains(stderr, "forbidden")
	}, 60*time.Second, 250*time.Millisecond, "the revoked certificate was never refused with 403")
	tokRevoked := revoke(tok.LeaseID)
	require.Eventually(t, func() bool {
		stderr, err := as(tokKC, "get", "configmaps")
		return err != nil && strings.Contains(stderr, "Unauthorized")
	}, 60*time.Second, 250*time.Millisecond, "the revoked token was never refused with 401")

	// A live lease, for the join from lease Secrets.
	live, liveKC := issue(`{"namespace":"argo","serviceAccount":"runner","ttl":"1h"}`, "audit-join-live")
	_, err = as(liveKC, "get", "configmaps")
	require.NoError(t, err)

	brokerLog := writeFile(t, filepath.Join(t.TempDir(), "broker.log"), e.proc.logs.String())
	bin := tokenbrokerBinary(t)

	t.Run("the API server names each credential as the broker recorded it, and nothing for a failed authentication", func(t *testing.T) {
		leaf, err := pki.ParseCertificatesPEM(kubeconfigCert(t, certKC))
		require.NoError(t, err)
		sum := sha256.Sum256(leaf[0].Raw)
		certID := "X509SHA256=" + hex.EncodeToString(sum[:])
		claims, err := pki.UnverifiedClaims(tok.Token)
		require.NoError(t, err)
		tokID := "JTI=" + claims.ID
		seen := map[string]bool{}
		unauthenticated := 0
		eachAPIEvent(t, c.AuditLogPath(), func(ev auditjoin.APIEvent) {
			switch {
			case ev.Username == cert.User:
				require.Equal(t, certID, ev.CredentialID)
				seen["cert"] = true
			case ev.Username == "system:serviceaccount:argo:runner" && ev.CredentialID == tokID:
				seen["token"] = true
			case ev.Code == 401:
				require.Empty(t, ev.CredentialID, "a failed authentication names no credential")
				unauthenticated++
			}
		})
		require.True(t, seen["cert"] && seen["token"], "both credentials' requests are in the audit log: %v", seen)
		require.Positive(t, unauthenticated)
	})

	t.Run("every request made with a broker credential is a row with its lease, peer and issuing request", func(t *testing.T) {
		out, stderr, err := runErr(bin, "audit", "--api-audit-log", c.AuditLogPath(), "--broker-audit-log", brokerLog, "-o", "json")
		require.NoError(t, err, stderr)
		rows := decodeRows(t, out)
		byLease := map[string][]auditjoin.Row{}
		for _, r := range rows {
			require.Equal(t, "west", r.Lease.Peer)
			byLease[r.Lease.ID] = append(byLease[r.Lease.ID], r)
		}
		has := func(id, verb, resource string, code int, state string) bool {
			for _, r := range byLease[id] {
				if r.Verb == verb && r.Resource == resource && r.Code == code && r.LeaseState == state {
					return true
				}
			}
			return false
		}
		require.True(t, has(tok.LeaseID, "list", "configmaps", 200, "live"), "token: list configmaps")
		require.True(t, has(tok.LeaseID, "list", "secrets", 403, "live"), "token: list secrets refused")
		require.True(t, has(cert.LeaseID, "get", "configmaps", 200, "live"), "certificate: get configmap")
		require.True(t, has(cert.LeaseID, "create", "configmaps", 403, "live"), "certificate: create refused")
		require.True(t, has(cert.LeaseID, "get", "configmaps", 403, "revoked"), "certificate: refused after its revocation, still attributed")
		for _, r := range byLease[tok.LeaseID] {
			require.NotEqual(t, 401, r.Code, "a 401 carries no credential id: it cannot be a row")
			if r.Time.After(tokRevoked.Add(time.Second)) {
				require.Equal(t, "revoked", r.LeaseState)
			}
		}
		for _, r := range byLease[cert.LeaseID] {
			if r.LeaseState == "revoked" {
				require.False(t, r.Time.Before(certRevoked.Add(-time.Second)))
			}
		}
		require.Equal(t, "audit-join-token", byLease[tok.LeaseID][0].Lease.IssueRequestID)
		require.Equal(t, "audit-join-cert", byLease[cert.LeaseID][0].Lease.IssueRequestID)
		require.NotEmpty(t, byLease[live.LeaseID])
		require.Regexp(t, `refused authentication \(401\)`, stderr)
		require.NotRegexp(t, ` 0 refused authentication`, stderr)

		// The filters and the table.
		out, stderr, err = runErr(bin, "audit", "--api-audit-log", c.AuditLogPath(), "--broker-audit-log", brokerLog, "--lease", cert.LeaseID)
		require.NoError(t, err, stderr)
		t.Logf("tokenbroker audit --lease %s:\n%s%s", cert.LeaseID, out, stderr)
		lines := strings.Split(strings.TrimSpace(out), "\n")
		require.Equal(t, "TIME", strings.Fields(lines[0])[0])
		for _, l := range lines[1:] {
			require.Contains(t, l, cert.LeaseID)
		}
		out, stderr, err = runErr(bin, "audit", "--api-audit-log", c.AuditLogPath(), "--broker-audit-log", brokerLog, "--peer", "nobody", "-o", "json")
		require.NoError(t, err, stderr)
		require.Empty(t, strings.TrimSpace(out))
		out, stderr, err = runErr(bin, "audit", "--api-audit-log", c.AuditLogPath(), "--broker-audit-log", brokerLog, "--since", time.Now().Add(time.Hour).Format(time.RFC3339), "-o", "json")
		require.NoError(t, err, stderr)
		require.Empty(t, strings.TrimSpace(out))
	})

	t.Run("the summary lists what each lease used and what its ServiceAccount never used", func(t *testing.T) {
		out, stderr, err := runErr(bin, "audit", "--api-audit-log", c.AuditLogPath(), "--broker-audit-log", brokerLog,
			"--kubeconfig", c.KubeconfigPath, "--summary", "-o", "json")
		require.NoError(t, err, stderr)
		type report struct {
			Kind  string          `json:"kind"`
			Lease auditjoin.Lease `json:"lease"`
			auditjoin.SubjectUsage
			AfterRevocation int                    `json:"afterRevocation"`
			Uses            []auditjoin.Use        `json:"uses"`
			Permissions     string                 `json:"permissions"`
			Bindings        []string               `json:"bindings"`
			Unused          []auditjoin.Permission `json:"unused"`
		}
		var leases = map[string]report{}
		var subjects []report
		sc := bufio.NewScanner(strings.NewReader(out))
		for sc.Scan() {
			var r report
			require.NoError(t, json.Unmarshal(sc.Bytes(), &r), sc.Text())
			if r.Kind == "lease" {
				leases[r.Lease.ID] = r
			} else {
				subjects = append(subjects, r)
			}
		}
		use := func(uses []auditjoin.Use, verb, resource string) auditjoin.Use {
			for _, u := range uses {
				if u.Verb == verb && u.Resource == resource && u.Group == "" {
					return u
				}
			}
			return auditjoin.Use{}
		}
		tokUses := leases[tok.LeaseID].Uses
		require.Positive(t, use(tokUses, "list", "configmaps").Count)
		require.Zero(t, use(tokUses, "list", "configmaps").Denied)
		require.Equal(t, use(tokUses, "list", "secrets").Count, use(tokUses, "list", "secrets").Denied)
		require.Positive(t, leases[cert.LeaseID].AfterRevocation)
		require.Positive(t, use(leases[cert.LeaseID].Uses, "get", "configmaps").Denied)

		var sa, user *report
		for i := range subjects {
			switch subjects[i].Subject.Kind {
			case auditjoin.SubjectServiceAccount:
				sa = &subjects[i]
			case auditjoin.SubjectUser:
				user = &subjects[i]
			}
		}
		require.NotNil(t, sa)
		require.Equal(t, "known", sa.Permissions)
		require.Contains(t, sa.Bindings, "argo/runner-view")
		require.ElementsMatch(t, []string{tok.LeaseID, live.LeaseID}, sa.Leases)
		require.Contains(t, sa.Unused, auditjoin.Permission{Verb: "get", Resource: "configmaps", Namespace: "argo"}, "the Role allows get; only list was used")
		require.NotContains(t, sa.Unused, auditjoin.Permission{Verb: "list", Resource: "configmaps", Namespace: "argo"})
		require.NotNil(t, user)
		require.Equal(t, cert.User, user.Subject.Name)
		require.Equal(t, "unbound", user.Permissions, "a revoked certificate's RoleBinding is gone")

		out, stderr, err = runErr(bin, "audit", "--api-audit-log", c.AuditLogPath(), "--broker-audit-log", brokerLog,
			"--kubeconfig", c.KubeconfigPath, "--summary", "--lease", tok.LeaseID)
		require.NoError(t, err, stderr)
		t.Logf("tokenbroker audit --summary --lease %s:\n%s", tok.LeaseID, out)
		require.Contains(t, out, "LEASE "+tok.LeaseID)
		require.Regexp(t, `never used: .*get configmaps`, out)
	})

	t.Run("live leases join from their Secrets without the broker's log", func(t *testing.T) {
		f, err := os.Open(c.AuditLogPath())
		require.NoError(t, err)
		defer f.Close()
		out, stderr, err := runErrStdin(f, bin, "audit", "--api-audit-log", "-", "--kubeconfig", c.KubeconfigPath, "-o", "json")
		require.NoError(t, err, stderr)
		rows := decodeRows(t, out)
		require.NotEmpty(t, rows)
		for _, r := range rows {
			require.Equal(t, live.LeaseID, r.Lease.ID, "only the live lease has a Secret")
			require.Equal(t, "west", r.Lease.Peer)
			require.Empty(t, r.Lease.IssueRequestID, "a Secret does not know the issuing request")
		}
	})
}

func decodeRows(t *testing.T, out string) []auditjoin.Row {
	t.Helper()
	var rows []auditjoin.Row
	sc := bufio.NewScanner(strings.NewReader(out))
	sc.Buffer(nil, 1<<20)
	for sc.Scan() {
		var r auditjoin.Row
		require.NoError(t, json.Unmarshal(sc.Bytes(), &r), sc.Text())
		rows = append(rows, r)
	}
	return rows
}

func eachAPIEvent(t *testing.T, path string, fn func(auditjoin.APIEvent)) {
	t.Helper()
	f, err := os.Open(path)
	require.NoError(t, err)
	defer f.Close()
	sc := bufio.NewScanner(f)
	sc.Buffer(nil, auditjoin.MaxLineBytes)
	for sc.Scan() {
		ev, err := auditjoin.ParseAPIEvent(sc.Bytes())
		require.NoError(t, err)
		if ev.Stage == "ResponseComplete" || ev.Code == 401 {
			fn(ev)
		}
	}
	require.NoError(t, sc.Err())
}

// runErrStdin is runErr with stdin, for "tokenbroker audit --api-audit-log -".
func runErrStdin(stdin io.Reader, name string, args ...string) (string, string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, name, args...)
	var stdout, stderr bytes.Buffer
	cmd.Stdin, cmd.Stdout, cmd.Stderr = stdin, &stdout, &stderr
	err := cmd.Run()
	errOut := stderr.String()
	collectLog("cli audit (stderr)", func() string { return errOut })
	return stdout.String(), stderr.String(), err
}

// kubeconfigCert is the client certificate of a kubeconfig file.
func kubeconfigCert(t *testing.T, path string) []byte {
	t.Helper()
	cfg, err := clientcmd.LoadFromFile(path)
	require.NoError(t, err)
	for _, a := range cfg.AuthInfos {
		if len(a.ClientCertificateData) > 0 {
			return a.ClientCertificateData
		}
	}
	t.Fatalf("%s holds no client certificate", path)
	return nil
}
