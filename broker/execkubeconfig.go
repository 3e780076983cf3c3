package broker

import (
	"context"

	"go.uber.org/zap"

	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
	"github.com/tokenbroker/tokenbroker/broker/audit"
	"github.com/tokenbroker/tokenbroker/broker/kubeconfig"
	"github.com/tokenbroker/tokenbroker/broker/policy"
	"github.com/tokenbroker/tokenbroker/broker/problem"
)

// ExecKubeconfig authorizes req for caller as IssueKubeconfig does, but
// issues nothing: it returns a kubeconfig whose user runs the exec
// credential plugin ("tokenbroker credential", found on the PATH) with
// req against brokerURL, the URL the caller reached this broker by. Its
// cluster is the policy's, or for a gateway decision the lease gateway's
// (its URL and CAs), where the plugin's lease certificate is good. The
// plugin reads the caller's identity from $TOKENBROKER_IDENTITY_DIR, as
// the broker cannot know where the caller keeps it. Asking now tells the
// caller at once whether the policy grants the request, rather than at its
// first kubectl. Every call ends in one audit event (ActionExecKubeconfig).
func (b *Broker) ExecKubeconfig(ctx context.Context, c Caller, req apiv1.KubeconfigRequest, brokerURL string) ([]byte, error) {
	a := &audit.Pending{Event: c.event(audit.ActionExecKubeconfig)}
	a.Event.Namespace, a.Event.ServiceAccount = req.Namespace, req.ServiceAccount
	a.Event.Credential, a.Event.RequestedTTL = policy.OrDefault(req.Credential, apiv1.CredentialToken), req.TTL
	kc, outcome, err := b.execKubeconfig(c, req, brokerURL, a)
	b.concludeOutcome(ctx, a, outcome, err)
	return kc, err
}

func (b *Broker) execKubeconfig(c Caller, req apiv1.KubeconfigRequest, brokerURL string, a *audit.Pending) ([]byte, string, error) {
	log := b.cfg.Logger.With(zap.String("identity", c.Identity), zap.String("namespace", req.Namespace), zap.String("service_account", req.ServiceAccount))
	dec, outcome, err := b.decide(c, req, a, log)
	if err != nil {
		return nil, outcome, err
	}
	if err := b.admission().Issuance(dec.policy, c.Identity, limitKey(c), dec.Peer, a); err != nil {
		return nil, outcomeLimited, err
	}
	cluster := dec.policy.Cluster
	if dec.Access == apiv1.AccessGateway {
		// The plugin's credential will be a lease certificate, good at the
		// gateway only: the kubeconfig names the gateway, as an issued
		// gateway kubeconfig does. decide answered 422 without one.
		if b.cfg.Gateway == nil {
			return nil, outcomeUnprocessable, problem.Errorf(problem.KindUnprocessable, "access gateway is not available from this broker: it runs no lease gateway (serve --gateway-address)")
		}
		if cluster, err = b.cfg.Gateway.cluster(cluster); err != nil {
			return nil, outcomeUnavailable, err
		}
	}
	kc, err := kubeconfig.Exec(cluster, req, brokerURL)
	if err != nil {
		return nil, outcomeError, err
	}
	log.Info("decision", zap.Bool("allowed", true), zap.String("peer", dec.Peer), zap.String("action", audit.ActionExecKubeconfig))
	return kc, outcomeGranted, nil
}
