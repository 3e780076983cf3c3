package agent

import (
	"strings"
	"testing"
	"time"

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
