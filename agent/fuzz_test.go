package agent

import (
	"slices"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/tokenbroker/tokenbroker/agent/config"
	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
)

// FuzzCredentialFromResponse feeds the checks of a broker's answer (and the
// kubeconfig parser behind them) arbitrary kubeconfigs and tokens: they must
// never panic, and an error must never quote the token.
func FuzzCredentialFromResponse(f *testing.F) {
	f.Add(testKubeconfig("https://east.example.com:6443", "tok-SECRET"), "tok-SECRET")
	f.Add(testKubeconfig("https://east.example.com:6443", "tok-SECRET"), "")
	f.Add("apiVersion: v1\nkind: Config\ncurrent-context: x\n", "tok-SECRET")
	f.Add("{", "tok-SECRET")
	f.Add("clusters: [{name: a, cluster: {server: 'https://a', tls-server-name: b, proxy-url: 'http://p:3128'}}]\ncontexts: [{name: c, context: {cluster: a, user: u}}]\nusers: [{name: u, user: {token: tok-SECRET}}]\ncurrent-context: c\n", "tok-SECRET")
	f.Add("clusters: [{name: a, cluster: {server: 'https://a'}}]\ncontexts: [{name: c, context: {cluster: a, user: u}}]\nusers: [{name: u, user: {token: tok-SECRET}}]\ncurrent-context: c\n", "x")
	f.Fuzz(func(t *testing.T, kubeconfig, token string) {
		c, err := credentialFromResponse(&apiv1.KubeconfigResponse{
			LeaseID: leaseID(1), Kubeconfig: kubeconfig, Token: token, ExpiresAt: t0.Add(time.Hour),
		}, t0)
		if err != nil {
			if token != "" && len(token) > 3 && strings.Contains(err.Error(), token) && !strings.Contains(errorsWithoutToken, token) {
				t.Fatalf("the error quotes the token: %v", err)
			}
			return
		}
		if c.Token == "" || c.Server == "" {
			t.Fatalf("accepted a credential without a token or server: %v", c)
		}
		if strings.Contains(c.String(), c.Token) && !strings.Contains(c.LeaseID, c.Token) {
			t.Fatalf("String() shows the token")
		}
	})
}

// errorsWithoutToken is the fixed text of the parser's errors; a token that
// happens to be a substring of it is not a leak.
const errorsWithoutToken = "unusable answer from the broker: lease aaaaaaaaaaaaaaaaaaaaaaaaab: no kubeconfig the kubeconfig does not parse " +
	"the kubeconfig has no current context the kubeconfig's current context has no server the kubeconfig's current context has no token " +
	"the token differs from the kubeconfig's expired at 2030-01-02T04:04:05Z, before it arrived"

// FuzzMergeKeepsWhatTheAgentDoesNotOwn feeds merge a Secret whose owned
// record (an annotation anyone who may edit the Secret can write) and keys
// are arbitrary: merge must not panic, must set everything the agent
// writes, and must leave every key the record does not name as it was.
func FuzzMergeKeepsWhatTheAgentDoesNotOwn(f *testing.F) {
	f.Add(`{"data":["kubeconfig"],"labels":["team"],"annotations":[]}`, "project", "team-a")
	f.Add(`{"data":["project"]}`, "project", "x")
	f.Add(`not json`, "kubeconfig", "hand-made")
	f.Add(`{"data":null,"labels":[""],"annotations":["tokenbroker.io/owned"]}`, "", "")
	f.Fuzz(func(t *testing.T, owned, key, value string) {
		want, err := renderSecret(config.SecretOutput{Namespace: "ns", Name: "n", Format: config.FormatKubeconfig}, goldenMeta, goldenCredential(t))
		if err != nil {
			t.Fatal(err)
		}
		cur := &corev1.Secret{
			ObjectMeta: metav1.ObjectMeta{
				Labels:      map[string]string{key: value},
				Annotations: map[string]string{config.AnnotationOwned: owned, key: value},
			},
			Data: map[string][]byte{key: []byte(value)},
		}
		prev := ownedFrom(cur)
		upd, _ := merge(cur, want)
		for k, v := range want.Data {
			if string(upd.Data[k]) != string(v) {
				t.Fatalf("data %q not written", k)
			}
		}
		for k, v := range want.Annotations {
			if upd.Annotations[k] != v {
				t.Fatalf("annotation %q not written", k)
			}
		}
		_, wantsKey := want.Data[key]
		if !wantsKey && !slices.Contains(prev.Data, key) && string(upd.Data[key]) != value {
			t.Fatalf("a foreign data key %q was changed", key)
		}
		_, wantsLabel := want.Labels[key]
		if !wantsLabel && !slices.Contains(prev.Labels, key) && upd.Labels[key] != value {
			t.Fatalf("a foreign label %q was changed", key)
		}
		if again, changed := merge(upd, want); changed {
			t.Fatalf("a second merge changed the Secret again: %v", again)
		}
	})
}
