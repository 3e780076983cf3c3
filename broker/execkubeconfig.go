package broker

import (
	"context"
	"fmt"

	"go.uber.org/zap"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"

	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
	"github.com/tokenbroker/tokenbroker/broker/audit"
	"github.com/tokenbroker/tokenbroker/broker/policy"
)

// pluginInstallHint is what client-go prints when the exec kubeconfig's
// command is not on the PATH.
const pluginInstallHint = `This kubeconfig runs "tokenbroker credential", the exec credential plugin of
the tokenbroker binary: put tokenbroker on your PATH, and set
TOKENBROKER_IDENTITY_DIR to your identity directory (tls.crt, tls.key, ca.crt).`

// ExecKubeconfig authorizes req for caller as IssueKubeconfig does, but
// issues nothing: it returns a kubeconfig whose user runs the exec
// credential plugin ("tokenbroker credential", found on the PATH) with
// req against brokerURL, the URL the caller reached this broker by. The
// plugin reads the caller's identity from $TOKENBROKER_IDENTITY_DIR, as
// the broker cannot know where the caller keeps it. Asking now tells the
// caller at once whether the policy grants the request, rather than at its
// first kubectl. Every call ends in one audit event (ActionExecKubeconfig).
func (b *Broker) ExecKubeconfig(ctx context.Context, c Caller, req apiv1.KubeconfigRequest, brokerURL string) ([]byte, error) {
	a := &pendingAudit{ev: audit.Event{
		Action:         audit.ActionExecKubeconfig,
		Identity:       c.Identity,
		CertSHA256:     c.CertSHA256,
		Namespace:      req.Namespace,
		ServiceAccount: req.ServiceAccount,
		Credential:     policy.OrDefault(req.Credential, apiv1.CredentialToken),
		RequestedTTL:   req.TTL,
	}}
	kc, outcome, err := b.execKubeconfig(c, req, brokerURL, a)
	b.concludeOutcome(ctx, a, outcome, err)
	return kc, err
}

func (b *Broker) execKubeconfig(c Caller, req apiv1.KubeconfigRequest, brokerURL string, a *pendingAudit) ([]byte, string, error) {
	log := b.cfg.Logger.With(zap.String("identity", c.Identity), zap.String("namespace", req.Namespace), zap.String("service_account", req.ServiceAccount))
	dec, outcome, err := b.decide(c, req, a, log)
	if err != nil {
		return nil, outcome, err
	}
	if err := b.admitIssuance(dec.policy, c.Identity, dec.Peer, a); err != nil {
		return nil, outcomeLimited, err
	}
	kc, err := execKubeconfig(dec.policy.Cluster, req, brokerURL)
	if err != nil {
		return nil, outcomeError, err
	}
	log.Info("decision", zap.Bool("allowed", true), zap.String("peer", dec.Peer), zap.String("action", audit.ActionExecKubeconfig))
	return kc, outcomeGranted, nil
}

// execKubeconfig is the kubeconfig of ExecKubeconfig, named like the ones
// with a credential: the user <serviceAccount>@<cluster> (for a client
// certificate, whose user is new at every lease, client-certificate@<cluster>)
// and the context <namespace>/<user>.
func execKubeconfig(cluster policy.ClusterSpec, req apiv1.KubeconfigRequest, brokerURL string) ([]byte, error) {
	subject := req.ServiceAccount
	if req.Credential == apiv1.CredentialClientCertificate {
		subject = "client-certificate"
	}
	user := subject + "@" + cluster.Name
	ctxName := req.Namespace + "/" + user
	cfg := clientcmdapi.NewConfig()
	cfg.Clusters[cluster.Name] = &clientcmdapi.Cluster{
		Server:                   cluster.Server,
		TLSServerName:            cluster.TLSServerName,
		ProxyURL:                 cluster.ProxyURL,
		CertificateAuthorityData: []byte(cluster.CAData),
	}
	cfg.AuthInfos[user] = &clientcmdapi.AuthInfo{Exec: &clientcmdapi.ExecConfig{
		APIVersion:      "client.authentication.k8s.io/v1",
		Command:         "tokenbroker",
		Args:            apiv1.PluginArgs(brokerURL, "", req),
		InstallHint:     pluginInstallHint,
		InteractiveMode: clientcmdapi.NeverExecInteractiveMode,
	}}
	cfg.Contexts[ctxName] = &clientcmdapi.Context{Cluster: cluster.Name, AuthInfo: user, Namespace: req.Namespace}
	cfg.CurrentContext = ctxName
	kc, err := clientcmd.Write(*cfg)
	if err != nil {
		return nil, fmt.Errorf("write exec kubeconfig: %w", err)
	}
	return kc, nil
}
