package config

import (
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
)

func TestTheExampleConfigParsesWithItsDefaults(t *testing.T) {
	t.Parallel()
	cfg, err := Parse(exampleConfigFile(t), "")
	require.NoError(t, err)
	require.Equal(t, "tokenbroker-agent", cfg.Identity.Secret.Namespace)
	require.Len(t, cfg.Targets, 2)
	require.True(t, cfg.UsesKubernetes())
	south := cfg.RefreshFor(1)
	require.Equal(t, 0.5, south.Fraction)
	require.Equal(t, 0.1, south.Jitter, "completed from the top level")
	require.Equal(t, 5*time.Minute, time.Duration(south.RevokeGrace))
	require.Equal(t, 5*time.Minute, time.Duration(south.MaxBackoff))
	require.Equal(t, 0.66, cfg.RefreshFor(0).Fraction)
}

func TestAMinimalConfigGetsEveryDefault(t *testing.T) {
	t.Parallel()
	cfg, err := Parse([]byte(`
identity: {dir: /id}
targets:
  - name: east
    broker: https://east.example.com:8443
    request: {namespace: argo, serviceAccount: sa}
    outputs: [{file: {path: /out/east}}]
`), "")
	require.NoError(t, err)
	require.InDelta(t, 2.0/3.0, cfg.Refresh.Fraction, 1e-12)
	require.Equal(t, 0.1, cfg.Refresh.Jitter)
	require.Equal(t, time.Second, time.Duration(cfg.Refresh.MinBackoff))
	require.Equal(t, 5*time.Minute, time.Duration(cfg.Refresh.MaxBackoff))
	require.Equal(t, 10*time.Minute, time.Duration(cfg.Refresh.RevokeGrace), "long enough for a rollout, a Flux reconcile or an Argo CD sync")
	require.Equal(t, 0.66, cfg.Identity.RenewAt)
	require.Equal(t, "https://east.example.com:8443", cfg.Identity.RenewBroker, "the first target's broker")
	require.Equal(t, ":9091", cfg.OpsAddress)
	require.False(t, cfg.UsesKubernetes())
}

func TestAClusterTrustBundleSourceGetsItsIntervalAndNeedsKubernetes(t *testing.T) {
	t.Parallel()
	cfg, err := Parse([]byte(`
identity:
  dir: /id
  trustBundleFrom:
    clusterTrustBundle:
      signerName: tokenbroker.io/east
      labelSelector: {matchLabels: {app.kubernetes.io/managed-by: tokenbroker}}
targets:
  - {name: east, broker: "https://east:8443", request: {namespace: a, serviceAccount: b}, outputs: [{file: {path: /out/east}}]}
`), "")
	require.NoError(t, err)
	require.Equal(t, DefaultTrustBundleInterval, time.Duration(cfg.Identity.TrustBundleFrom.ClusterTrustBundle.Interval))
	require.True(t, cfg.UsesKubernetes())
}

func TestRelativePathsAreTakenRelativeToTheConfigFile(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	path := filepath.Join(dir, "agent.yaml")
	require.NoError(t, os.WriteFile(path, []byte(`
identity:
  dir: identity
  enroll: {broker: "https://e:8444", caFingerprint: "sha256:`+strings.Repeat("ab", 32)+`", tokenFile: join.token}
kubeconfig: west.kubeconfig
targets:
  - name: east
    broker: https://east.example.com:8443
    request: {namespace: argo, serviceAccount: sa}
    outputs: [{file: {path: out/east.kubeconfig}}, {file: {path: /abs/east.kubeconfig}}]
`), 0o600))
	cfg, err := Load(path)
	require.NoError(t, err)
	require.Equal(t, filepath.Join(dir, "identity"), cfg.Identity.Dir)
	require.Equal(t, filepath.Join(dir, "join.token"), cfg.Identity.Enroll.TokenFile)
	require.Equal(t, filepath.Join(dir, "west.kubeconfig"), cfg.Kubeconfig)
	require.Equal(t, filepath.Join(dir, "out/east.kubeconfig"), cfg.Targets[0].Outputs[0].File.Path)
	require.Equal(t, "/abs/east.kubeconfig", cfg.Targets[0].Outputs[1].File.Path)
}

func TestAnUnknownFieldIsRejected(t *testing.T) {
	t.Parallel()
	_, err := Parse([]byte("identity: {dir: /id}\nrefresh: {fraktion: 0.5}\n"), "")
	require.ErrorContains(t, err, `unknown field "fraktion"`)
}

func TestConfigValidationReportsEveryProblemWithItsFieldPath(t *testing.T) {
	t.Parallel()
	const target = `
  - name: east
    broker: https://east.example.com:8443
    request: {namespace: argo, serviceAccount: sa}
    outputs: [{file: {path: /out/east}}]`
	for _, tc := range []struct {
		name string
		yaml string
		want []string // "field: detail" fragments
	}{
		{"no identity store", "identity: {}\ntargets:" + target, []string{"identity: give dir, secret or podCertificate"}},
		{"both identity stores", "identity: {dir: /id, secret: {namespace: a, name: b}}\ntargets:" + target, []string{"identity: give one of dir, secret and podCertificate"}},
		{"a bad identity secret", "identity: {secret: {namespace: Bad_NS}}\ntargets:" + target,
			[]string{"identity.secret.namespace:", "identity.secret.name: is required"}},
		{"renewAt out of range", "identity: {dir: /id, renewAt: 1.5}\ntargets:" + target, []string{"identity.renewAt: must be between 0 and 1"}},
		{"an http renew broker", "identity: {dir: /id, renewBroker: 'http://e'}\ntargets:" + target, []string{"identity.renewBroker: must be an https://"}},
		{"an incomplete enroll", "identity: {dir: /id, enroll: {broker: 'e:8444', caFingerprint: 'md5:1'}}\ntargets:" + target,
			[]string{"identity.enroll.broker: must be an https://", "identity.enroll.caFingerprint:", "identity.enroll.tokenFile: is required"}},
		{"a trust source without a kind", "identity: {dir: /id, trustBundleFrom: {}}\ntargets:" + target, []string{"identity.trustBundleFrom: give clusterTrustBundle"}},
		{"a ClusterTrustBundle source without a signer", "identity: {dir: /id, trustBundleFrom: {clusterTrustBundle: {}}}\ntargets:" + target,
			[]string{"identity.trustBundleFrom.clusterTrustBundle.signerName: is required: only bundles linked to a signer are trusted"}},
		{"a ClusterTrustBundle source with a bad signer, selector and interval",
			"identity: {dir: /id, trustBundleFrom: {clusterTrustBundle: {signerName: east, interval: 2h, labelSelector: {matchExpressions: [{key: a, operator: Bad}]}}}}\ntargets:" + target,
			[]string{"identity.trustBundleFrom.clusterTrustBundle.signerName: signer name \"east\"", "identity.trustBundleFrom.clusterTrustBundle.labelSelector:", "identity.trustBundleFrom.clusterTrustBundle.interval: must be between 1s and 1h"}},
		{"no targets", "identity: {dir: /id}", []string{"targets: at least one target is required"}},
		{"a bad fraction", "identity: {dir: /id}\nrefresh: {fraction: 1}\ntargets:" + target, []string{"refresh.fraction: must be between 0 and 1"}},
		{"a negative jitter", "identity: {dir: /id}\nrefresh: {jitter: -0.5}\ntargets:" + target, []string{"refresh.jitter:"}},
		{"backoff bounds upside down", "identity: {dir: /id}\nrefresh: {minBackoff: 1m, maxBackoff: 1s}\ntargets:" + target,
			[]string{"refresh.maxBackoff: must not be shorter than minBackoff"}},
		{"a bad ops address", "identity: {dir: /id}\nopsAddress: nine\ntargets:" + target, []string{"opsAddress:"}},
		{"a target that is wrong everywhere", `identity: {dir: /id}
targets:
  - name: East_1
    broker: http://east
    request: {namespace: "", serviceAccount: "", ttl: soon, minTTL: 2h}
    refresh: {fraction: 2}
    outputs:
      - {}
      - secret: {namespace: a, name: b, format: fluxcd, labels: {app.kubernetes.io/managed-by: me}, annotations: {tokenbroker.io/lease-id: x}}
        file: {path: /x}`,
			[]string{
				"targets[0].name: must be a DNS label",
				"targets[0].broker: must be an https://",
				"targets[0].request.namespace: is required",
				"targets[0].request.serviceAccount: is required",
				"targets[0].request.ttl: must be a duration",
				"targets[0].refresh.fraction:",
				"targets[0].outputs[0]: give secret, file or clusterProfile",
				"targets[0].outputs[1]: give one of secret, file and clusterProfile",
			}},
		{"a bad secret output", `identity: {dir: /id}
targets:
  - name: east
    broker: https://east.example.com:8443
    request: {namespace: argo, serviceAccount: sa, ttl: 1h, minTTL: 2h, audiences: [""]}
    outputs:
      - secret: {namespace: a, name: b, format: fluxcd, labels: {app.kubernetes.io/managed-by: me}, annotations: {tokenbroker.io/lease-id: x}}`,
			[]string{
				"targets[0].request.minTTL: must not be longer than ttl",
				"targets[0].request.audiences[0]: must not be empty",
				`targets[0].outputs[0].secret.format: unknown format "fluxcd"`,
				`targets[0].outputs[0].secret.labels: "app.kubernetes.io/managed-by" is set by the agent`,
				`targets[0].outputs[0].secret.annotations: "tokenbroker.io/lease-id" is set by the agent`,
			}},
		{"consumer options that conflict with the format", `identity: {dir: /id}
targets:
  - name: east
    broker: https://east.example.com:8443
    request: {namespace: argo, serviceAccount: sa}
    outputs:
      - secret: {namespace: a, name: argo, format: argocd, key: kubeconfig, labels: {argocd.argoproj.io/secret-type: repository},
                 argocd: {project: Team_A, namespaces: [apps, apps, Bad], clusterResources: true, shard: -1}}
      - secret: {namespace: a, name: flux, format: flux, key: "bad/key", labels: {reconcile.fluxcd.io/watch: Disabled}, argocd: {project: p}}
      - secret: {namespace: a, name: watched, format: kubeconfig, key: kubeconfig.yaml, labels: {reconcile.fluxcd.io/watch: Enabled}}`,
			[]string{
				"targets[0].outputs[0].secret.key: the argocd format has fixed keys",
				`targets[0].outputs[0].secret.labels: "argocd.argoproj.io/secret-type" is set by the agent for format argocd`,
				"targets[0].outputs[0].secret.argocd.project:",
				`targets[0].outputs[0].secret.argocd.namespaces[1]: duplicate namespace "apps"`,
				"targets[0].outputs[0].secret.argocd.namespaces[2]:",
				"targets[0].outputs[0].secret.argocd.shard: must not be negative",
				"targets[0].outputs[1].secret.key:",
				`targets[0].outputs[1].secret.labels: "reconcile.fluxcd.io/watch" is set by the agent for format flux`,
				`targets[0].outputs[1].secret.argocd: is only for format argocd, not "flux"`,
			}},
		{"a revokeGrace the credential does not live to see", `identity: {dir: /id}
refresh: {fraction: 0.5}
targets:
  - name: east
    broker: https://east.example.com:8443
    request: {namespace: argo, serviceAccount: sa, ttl: 10m}
    outputs: [{file: {path: /out/east}}]
  - name: west
    broker: https://east.example.com:8443
    request: {namespace: argo, serviceAccount: sa, ttl: 1h}
    refresh: {fraction: 0.9, revokeGrace: 6m}
    outputs: [{file: {path: /out/west}}]`,
			[]string{
				"targets[0].refresh.revokeGrace: 10m0s is not shorter than what is left of the credential when it is replaced (request.ttl 10m0s × (1 − fraction 0.5) = 5m0s)",
				"targets[1].refresh.revokeGrace: 6m0s is not shorter than what is left of the credential when it is replaced (request.ttl 1h0m0s × (1 − fraction 0.9) = 6m0s)",
			}},
		{"duplicate names and outputs", `identity: {secret: {namespace: ns, name: id}}
targets:
  - name: east
    broker: https://east.example.com:8443
    request: {namespace: argo, serviceAccount: sa}
    outputs:
      - secret: {namespace: admiralty, name: east, format: admiralty}
      - file: {path: /out/east}
      - secret: {namespace: ns, name: id, format: kubeconfig}
  - name: east
    broker: https://east.example.com:8443
    request: {namespace: argo, serviceAccount: sa}
    outputs:
      - secret: {namespace: admiralty, name: east, format: flux}
      - file: {path: /out/../out/east}
      - file: {path: /out/east.meta}`,
			[]string{
				`targets[1].name: duplicate target name "east" (also targets[0])`,
				"targets[0].outputs[2].secret: Secret ns/id is already written by identity.secret",
				"targets[1].outputs[0].secret: Secret admiralty/east is already written by targets[0].outputs[0].secret",
				"targets[1].outputs[1].file.path: file /out/east is already written by targets[0].outputs[1].file.path",
				"targets[1].outputs[2].file.path: file /out/east.meta is already written by targets[0].outputs[1].file.path (its .meta file)",
			}},
		{"token files that cannot be", `identity: {dir: /id}
targets:
  - name: east
    broker: https://east.example.com:8443
    request: {namespace: argo, serviceAccount: sa}
    outputs:
      - file: {path: /out/east, tokenFile: ../token}
      - file: {path: /out/west, tokenFile: west.meta}
      - file: {path: /out/south, tokenFile: token}
      - file: {path: /out/token}
  - name: cert
    broker: https://east.example.com:8443
    request: {namespace: argo, credential: clientCertificate}
    outputs:
      - file: {path: /out/cert, tokenFile: cert-token}`,
			[]string{
				`targets[0].outputs[0].file.tokenFile: must be a file name beside the kubeconfig, without a directory, not "../token"`,
				"targets[0].outputs[1].file.tokenFile: must not be the kubeconfig or its .meta file",
				"targets[0].outputs[3].file.path: file /out/token is already written by targets[0].outputs[2].file.path (its token file)",
				"targets[1].outputs[0].file.tokenFile: holds a token, and this target asks for a client certificate",
			}},
	} {
		_, err := Parse([]byte(tc.yaml), "")
		var ce *apiv1.ValidationError
		require.True(t, errors.As(err, &ce), "%s: %v", tc.name, err)
		for _, w := range tc.want {
			require.Contains(t, err.Error(), w, tc.name)
		}
	}
}

func TestConsumerOptionsThatFitTheirFormatAreAccepted(t *testing.T) {
	t.Parallel()
	cfg, err := Parse([]byte(`identity: {dir: /id}
targets:
  - name: east
    broker: https://east.example.com:8443
    request: {namespace: argo, serviceAccount: sa, ttl: 24h}
    outputs:
      - secret: {namespace: argocd, name: east, format: argocd, adopt: true,
                 argocd: {name: east-prod, project: team-a, namespaces: [apps], clusterResources: true, shard: 0}}
      - secret: {namespace: kargo, name: east, format: kubeconfig, key: kubeconfig.yaml}
      - secret: {namespace: tenant, name: east, format: kubeconfig, key: kubeconfig, labels: {reconcile.fluxcd.io/watch: Enabled}}
      - secret: {namespace: flux-system, name: east, format: flux, key: value.yaml}
`), "")
	require.NoError(t, err)
	outs := cfg.Targets[0].Outputs
	require.True(t, outs[0].Secret.Adopt)
	require.Equal(t, int64(0), *outs[0].Secret.ArgoCD.Shard, "shard 0 is a shard, not unset")
	require.Equal(t, "kubeconfig.yaml", outs[1].Secret.DataKey())
	require.Equal(t, "value.yaml", outs[3].Secret.DataKey())
	require.Equal(t, 10*time.Minute, time.Duration(cfg.RefreshFor(0).RevokeGrace), "the default grace fits a 24h token")
}

func TestARequestIsValidatedOnItsOwn(t *testing.T) {
	t.Parallel()
	require.NoError(t, RequestConfig{Namespace: "argo", ServiceAccount: "sa", TTL: "1h"}.Validate())
	err := RequestConfig{Namespace: "argo", ServiceAccount: "sa", TTL: "-1h"}.Validate()
	require.ErrorContains(t, err, "request.ttl: must be positive")
}

// exampleConfigFile is the complete example of the configuration file,
// which the guides quote.
func exampleConfigFile(t *testing.T) []byte {
	t.Helper()
	b, err := os.ReadFile(filepath.Join("testdata", "example.yaml"))
	require.NoError(t, err)
	return b
}

// A gateway request is the broker's rule set (a ServiceAccount, a token
// grant's credential, no audiences) plus the agent's own: no output that
// can carry only a token.
func TestAGatewayRequestTakesAServiceAccountAndOutputsThatCarryACertificate(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name, yaml string
		want       []string
	}{
		{"every format but a token file", `identity: {dir: /id}
targets:
  - name: east
    broker: https://east.example.com:8443
    request: {namespace: argo, serviceAccount: sa, access: gateway}
    outputs:
      - secret: {namespace: admiralty, name: east, format: admiralty}
      - secret: {namespace: argocd, name: east, format: argocd}
      - secret: {namespace: flux-system, name: east, format: flux}
      - secret: {namespace: kargo, name: east, format: kubeconfig, key: kubeconfig.yaml}
      - secret: {namespace: kueue-system, name: east, format: multikueue}
      - clusterProfile: {namespace: kueue-system}
      - file: {path: /out/east}`, nil},
		{"no ServiceAccount", `identity: {dir: /id}
targets:
  - {name: east, broker: "https://east:8443", request: {namespace: argo, access: gateway}, outputs: [{file: {path: /out/east}}]}`,
			[]string{"targets[0].request.serviceAccount: is required"}},
		{"a client certificate", `identity: {dir: /id}
targets:
  - {name: east, broker: "https://east:8443", request: {namespace: argo, credential: clientCertificate, access: gateway}, outputs: [{file: {path: /out/east}}]}`,
			[]string{"targets[0].request.credential: must be token (or empty) with access gateway"}},
		{"audiences", `identity: {dir: /id}
targets:
  - {name: east, broker: "https://east:8443", request: {namespace: argo, serviceAccount: sa, audiences: [vault], access: gateway}, outputs: [{file: {path: /out/east}}]}`,
			[]string{"targets[0].request.audiences: must be empty with access gateway"}},
		{"an unknown mode", `identity: {dir: /id}
targets:
  - {name: east, broker: "https://east:8443", request: {namespace: argo, serviceAccount: sa, access: proxy}, outputs: [{file: {path: /out/east}}]}`,
			[]string{`targets[0].request.access: must be "direct" or "gateway"`}},
		{"a token file", `identity: {dir: /id}
targets:
  - {name: east, broker: "https://east:8443", request: {namespace: argo, serviceAccount: sa, access: gateway}, outputs: [{file: {path: /out/east, tokenFile: token}}]}`,
			[]string{"targets[0].outputs[0].file.tokenFile: holds a token, and this target asks for access gateway, whose credential is a client certificate and key"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			cfg, err := Parse([]byte(tc.yaml), "")
			if tc.want == nil {
				require.NoError(t, err)
				require.Equal(t, apiv1.AccessGateway, cfg.Targets[0].Request.APIRequest().Access, "the request sent says gateway")
				return
			}
			var ve *apiv1.ValidationError
			require.True(t, errors.As(err, &ve), "%v", err)
			for _, w := range tc.want {
				require.Contains(t, err.Error(), w)
			}
		})
	}
}

// A target's request is read from the agent's config and written into the
// digest the agent records with the JSON names of POST /v1/kubeconfigs, in
// one order, leaving out what is empty; it is sent as the request it
// reads. A CSR is never part of it: the agent makes one for each request.
func TestARequestReadsAndWritesTheJSONOfTheBrokersRequest(t *testing.T) {
	t.Parallel()
	const raw = `{"namespace":"argo","serviceAccount":"sa","ttl":"2h","minTTL":"1h","audiences":["a","b"],"credential":"token","access":"gateway"}`
	dec := json.NewDecoder(strings.NewReader(raw))
	dec.DisallowUnknownFields()
	var r RequestConfig
	require.NoError(t, dec.Decode(&r))
	require.Equal(t, apiv1.KubeconfigRequest{Namespace: "argo", ServiceAccount: "sa", TTL: "2h", MinTTL: "1h",
		Audiences: []string{"a", "b"}, Credential: apiv1.CredentialToken, Access: apiv1.AccessGateway}, r.APIRequest())
	out, err := json.Marshal(r)
	require.NoError(t, err)
	require.Equal(t, raw, string(out))
	out, err = json.Marshal(RequestConfig{Namespace: "argo"})
	require.NoError(t, err)
	require.Equal(t, `{"namespace":"argo"}`, string(out))

	_, err = Parse([]byte(`
identity: {dir: /id}
targets:
  - name: east
    broker: https://east.example.com:8443
    request: {namespace: argo, serviceAccount: sa, csr: x}
    outputs: [{file: {path: /out/east}}]
`), "")
	require.ErrorContains(t, err, `unknown field "csr"`)
}

func TestAnAccessModeIsSentAndNamedInMessages(t *testing.T) {
	t.Parallel()
	direct := RequestConfig{Namespace: "argo", ServiceAccount: "sa"}
	require.Empty(t, direct.APIRequest().Access, "no access: the grant's mode")
	gw := direct
	gw.Access = apiv1.AccessGateway
	require.Equal(t, apiv1.AccessGateway, gw.APIRequest().Access)
	require.Equal(t, "argo/sa through the lease gateway", gw.Subject())
	require.Equal(t, "argo/sa", direct.Subject())
}

func TestAGatewayTargetIsNotedWithWhatTheBrokerMustHave(t *testing.T) {
	t.Parallel()
	doc := map[string]any{"targets": []any{
		map[string]any{"name": "east", "request": map[string]any{"namespace": "argo", "serviceAccount": "sa"}},
		map[string]any{"name": "gw", "request": map[string]any{"namespace": "argo", "serviceAccount": "sa", "access": "gateway"}},
	}}
	notes := Notes(doc)
	require.Len(t, notes, 1)
	require.Equal(t, "targets[1].request.access", notes[0].Field)
	require.Contains(t, notes[0].Detail, "grant with access: gateway")
	require.Contains(t, notes[0].Detail, "serve --gateway-address")
}

func TestAPodSignerGetsItsLifetimeNeedsKubernetesAndAValidSignerName(t *testing.T) {
	t.Parallel()
	cfg, err := Parse([]byte(`
identity: {secret: {namespace: tokenbroker-agent, name: agent-identity}, renewBroker: "https://east:8443"}
podSigner: {signerName: tokenbroker.io/workloads}
`), "")
	require.NoError(t, err, "a pod signer alone needs no target")
	require.Equal(t, 24*time.Hour, time.Duration(cfg.PodSigner.MaxLifetime))
	require.True(t, cfg.UsesKubernetes())

	for signer, want := range map[string]string{
		`{signerName: ""}`:                                   "is required",
		`{signerName: workloads}`:                            "<domain>/<path>",
		`{signerName: "Tokenbroker.IO/workloads"}`:           "<domain>/<path>",
		`{signerName: kubernetes.io/kube-apiserver-client}`:  "Kubernetes' own",
		`{signerName: tokenbroker.io/w, maxLifetime: 30m}`:   "between 1h",
		`{signerName: tokenbroker.io/w, maxLifetime: 2400h}`: "between 1h",
	} {
		_, err := Parse([]byte("identity: {dir: /id, renewBroker: \"https://east:8443\"}\npodSigner: "+signer+"\n"), "")
		var ve *apiv1.ValidationError
		require.ErrorAs(t, err, &ve, signer)
		require.Contains(t, ve.Error(), want, signer)
	}
}
