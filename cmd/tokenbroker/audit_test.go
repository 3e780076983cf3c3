package main

import (
	"bytes"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	metadatafake "k8s.io/client-go/metadata/fake"
	clienttesting "k8s.io/client-go/testing"

	"github.com/tokenbroker/tokenbroker/broker/objects"
)

func TestAuditOptionsAreCheckedWithMessagesThatSayWhatToGive(t *testing.T) {
	t.Parallel()
	now := time.Date(2030, 1, 1, 12, 0, 0, 0, time.UTC)
	for _, tc := range []struct {
		name string
		o    auditOptions
		err  string
	}{
		{"the API server's log is required", auditOptions{BrokerAuditLogs: []string{"b"}, Output: "table"}, "--api-audit-log is required"},
		{"leases come from the broker's log or the cluster", auditOptions{APIAuditLog: "a", Output: "table"}, "--broker-audit-log FILE"},
		{"only one input reads stdin", auditOptions{APIAuditLog: "-", BrokerAuditLogs: []string{"-"}, Output: "table"}, "only one input"},
		{"a lease id has the lease id's shape", auditOptions{APIAuditLog: "a", BrokerAuditLogs: []string{"b"}, Lease: "../x", Output: "table"}, "is not a lease id"},
		{"since is a time or a duration", auditOptions{APIAuditLog: "a", BrokerAuditLogs: []string{"b"}, Since: "yesterday", Output: "table"}, "neither an RFC 3339 time"},
		{"the output is table or json", auditOptions{APIAuditLog: "a", BrokerAuditLogs: []string{"b"}, Output: "yaml"}, "--output must be one of table, json"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			require.ErrorContains(t, tc.o.validate(now), tc.err)
		})
	}
	o := auditOptions{APIAuditLog: "a", Kubeconfig: "k", Since: "2h", Output: "json"}
	require.ErrorContains(t, o.validate(now), "--max-gateway-requests must be at least 1, not 0")
	o.MaxGatewayRequests = 1
	require.NoError(t, o.validate(now))
	require.Equal(t, now.Add(-2*time.Hour), o.since)
}

func TestAuditPrintsJoinedRequestsAndSaysWhatItCouldNotAttribute(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	const lease = "aaaaaaaaaaaaaaaaaaaaaaaaaa"
	broker := `{"level":"info","msg":"decision"}
{"time":"2030-01-01T10:00:00Z","audit":"tokenbroker.io/v1","action":"issue","decision":"allow","request_id":"REQ1","peer":"west","namespace":"argo","service_account":"runner","credential":"token","lease_id":"` + lease + `","credential_id":"JTI=j1","expires_at":"2030-01-01T12:00:00Z","workload":"wf/submitter","grant":"runners"}
`
	api := `{"kind":"Event","apiVersion":"audit.k8s.io/v1","stage":"ResponseComplete","verb":"list","requestURI":"/api/v1/namespaces/argo/configmaps","user":{"username":"system:serviceaccount:argo:runner","extra":{"authentication.kubernetes.io/credential-id":["JTI=j1"]}},"objectRef":{"resource":"configmaps","namespace":"argo"},"responseStatus":{"code":200},"requestReceivedTimestamp":"2030-01-01T10:01:00.000000Z"}
{"kind":"Event","apiVersion":"audit.k8s.io/v1","stage":"ResponseStarted","verb":"list","requestURI":"/api/v1/namespaces/argo/configmaps","user":{},"responseStatus":{"code":401},"requestReceivedTimestamp":"2030-01-01T10:02:00.000000Z"}
`
	brokerFile := filepath.Join(dir, "broker.log")
	require.NoError(t, os.WriteFile(brokerFile, []byte(broker), 0o600))
	var out, errOut bytes.Buffer
	o := auditOptions{APIAuditLog: "-", BrokerAuditLogs: []string{brokerFile}, Output: "table"}
	require.NoError(t, runAudit(t.Context(), o, auditClients{}, strings.NewReader(api), &out, &errOut))
	lines := strings.Split(strings.TrimSpace(out.String()), "\n")
	require.Len(t, lines, 2, out.String())
	require.Equal(t, []string{"TIME", "VERB", "RESOURCE", "NAMESPACE", "NAME", "CODE", "LEASE", "STATE", "PEER", "WORKLOAD", "ISSUE-REQUEST", "IMPERSONATING"}, strings.Fields(lines[0]))
	require.Equal(t, []string{"2030-01-01T10:01:00Z", "list", "configmaps", "argo", "<none>", "200", lease, "live", "west", "wf/submitter", "REQ1", "<none>"}, strings.Fields(lines[1]))
	require.Contains(t, errOut.String(), "2 requests read, 1 made with a broker credential, 1 selected; 1 refused authentication (401)")

	out.Reset()
	o.Summary = true
	require.NoError(t, runAudit(t.Context(), o, auditClients{}, strings.NewReader(api), &out, &errOut))
	require.Contains(t, out.String(), "LEASE "+lease+"  token, peer west, system:serviceaccount:argo:runner")
	require.Contains(t, out.String(), "GRANT runners  system:serviceaccount:argo:runner, 1 leases, 1 requests")
	require.Contains(t, out.String(), "permissions unknown: give --kubeconfig")
}

func TestAuditFromLeaseSecretsListsTheirMetadataOfTheLeaseTypeAndMarksTheirSource(t *testing.T) {
	t.Parallel()
	const lease = "aaaaaaaaaaaaaaaaaaaaaaaaaa"
	scheme := metadatafake.NewTestScheme()
	require.NoError(t, metav1.AddMetaToScheme(scheme))
	scheme.AddKnownTypeWithName(corev1.SchemeGroupVersion.WithKind("Secret"), &metav1.PartialObjectMetadata{})
	scheme.AddKnownTypeWithName(corev1.SchemeGroupVersion.WithKind("SecretList"), &metav1.PartialObjectMetadataList{})
	secret := &metav1.PartialObjectMetadata{
		TypeMeta: metav1.TypeMeta{APIVersion: "v1", Kind: "Secret"},
		ObjectMeta: metav1.ObjectMeta{Namespace: "argo", Name: "tokenbroker-lease-" + lease, CreationTimestamp: metav1.NewTime(time.Date(2030, 1, 1, 10, 0, 0, 0, time.UTC)),
			Labels:      map[string]string{objects.LabelManagedBy: objects.ManagedByValue, objects.LabelKind: objects.LeaseKind, objects.LabelLeaseID: lease, objects.LabelPeer: "west"},
			Annotations: map[string]string{objects.AnnotationSA: "runner", objects.AnnotationCred: "token", objects.AnnotationCredentialID: "JTI=j1"}},
	}
	meta := metadatafake.NewSimpleMetadataClient(scheme, secret)
	var fieldSelector string
	meta.PrependReactor("list", "secrets", func(a clienttesting.Action) (bool, runtime.Object, error) {
		fieldSelector = a.(clienttesting.ListActionImpl).GetListRestrictions().Fields.String()
		return false, nil, nil
	})
	api := `{"kind":"Event","apiVersion":"audit.k8s.io/v1","auditID":"1","stage":"ResponseComplete","verb":"list","requestURI":"/api/v1/namespaces/argo/configmaps","user":{"username":"system:serviceaccount:argo:runner","extra":{"authentication.kubernetes.io/credential-id":["JTI=j1"]}},"objectRef":{"resource":"configmaps","namespace":"argo"},"responseStatus":{"code":200},"requestReceivedTimestamp":"2030-01-01T10:01:00.000000Z"}
{"kind":"Event","apiVersion":"audit.k8s.io/v1","auditID":"2","stage":"ResponseComplete","verb":"list","requestURI":"/api/v1/namespaces/kube-system/secrets","user":{"username":"system:serviceaccount:kube-system:admin","extra":{"authentication.kubernetes.io/credential-id":["JTI=j1"]}},"objectRef":{"resource":"secrets","namespace":"kube-system"},"responseStatus":{"code":200},"requestReceivedTimestamp":"2030-01-01T10:02:00.000000Z"}
`
	var out, errOut bytes.Buffer
	o := auditOptions{APIAuditLog: "-", Kubeconfig: "k", Output: "table"}
	require.NoError(t, runAudit(t.Context(), o, auditClients{meta: meta}, strings.NewReader(api), &out, &errOut))
	require.Equal(t, "type=tokenbroker.io/lease", fieldSelector, "a Secret of another type with the lease labels is not a lease")
	lines := strings.Split(strings.TrimSpace(out.String()), "\n")
	require.Len(t, lines, 2, out.String())
	require.Equal(t, []string{"2030-01-01T10:01:00Z", "list", "configmaps", "argo", "<none>", "200", lease, "live,secret", "west", "<none>", "<none>", "<none>"}, strings.Fields(lines[1]))
	require.Contains(t, errOut.String(), "1 of the joined requests are of leases known only from their lease Secrets")
	require.Contains(t, errOut.String(), "1 requests name a lease's credential id but were made by another user than the lease's subject")
}

// Gateway requests past --max-gateway-requests are reported, never
// dropped silently; a stream known only from its start still joins.
func TestAuditReportsTheGatewayRequestsItCouldNotIndex(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	const lease = "cccccccccccccccccccccccccc"
	gw := func(action, id string) string {
		return `{"time":"2030-01-01T10:01:00Z","audit":"tokenbroker.io/v1","action":"` + action + `","decision":"allow","lease_id":"` + lease + `","namespace":"argo","service_account":"runner","api_audit_id":"` + id + `"}` + "\n"
	}
	broker := `{"time":"2030-01-01T10:00:00Z","audit":"tokenbroker.io/v1","action":"issue","decision":"allow","peer":"west","namespace":"argo","service_account":"runner","credential":"token","lease_id":"` + lease + `","credential_id":"X509SHA256=cc","expires_at":"2030-01-01T12:00:00Z"}` + "\n" +
		gw("gateway_forward", "id-1") + gw("gateway_request", "id-2") + gw("gateway_request", "id-3")
	api := ""
	for _, id := range []string{"id-1", "id-2", "id-3"} {
		api += `{"kind":"Event","apiVersion":"audit.k8s.io/v1","auditID":"` + id + `","stage":"ResponseComplete","verb":"watch","requestURI":"/api/v1/namespaces/argo/configmaps","user":{"username":"system:serviceaccount:argo:runner","extra":{"authentication.kubernetes.io/credential-id":["JTI=gateway"]}},"objectRef":{"resource":"configmaps","namespace":"argo"},"responseStatus":{"code":200},"requestReceivedTimestamp":"2030-01-01T10:01:00.000000Z"}` + "\n"
	}
	brokerFile := filepath.Join(dir, "broker.log")
	require.NoError(t, os.WriteFile(brokerFile, []byte(broker), 0o600))
	var out, errOut bytes.Buffer
	o := auditOptions{APIAuditLog: "-", BrokerAuditLogs: []string{brokerFile}, Output: "json", MaxGatewayRequests: 2}
	require.NoError(t, runAudit(t.Context(), o, auditClients{}, strings.NewReader(api), &out, &errOut))
	require.Len(t, strings.Split(strings.TrimSpace(out.String()), "\n"), 2, out.String())
	require.Contains(t, errOut.String(), "3 requests read, 2 made with a broker credential, 2 selected;")
	require.Contains(t, errOut.String(), "2 of the joined requests came through the lease gateway, joined by the api_audit_id of its events; 1 of them known only from the start of their stream")
	require.Contains(t, errOut.String(), "warning: at least 1 gateway requests not indexed (over the limit of 2; 1 gateway events skipped): their API server events are unjoined")
}
